"""The policies compared on a trace (docs/simulation.md has the table).

- ``fixed-<B>``: GBS ``B`` (a traced one) all along, on one GPU type and GPU count,
  the one that finishes soonest: what a user does without jabas.
- ``ddp-all``: every GPU of every type, same LBS and micro-steps everywhere (plain
  DDP on a mixed cluster, the slowest GPU pacing everyone), at the traced GBS that
  finishes soonest.
- ``pollux``: goodput-adaptive GBS (and GPU count) on one GPU type, the type that
  finishes soonest; cost-unaware, as Pollux is; it changes GPU count only when the
  predicted gain over the rest of the job pays for the restart.
- ``jabas``: IIDP over every type (same LBS everywhere, faster types run more
  micro-steps), the goodput-optimal GBS of each candidate allocation, and an
  allocation chosen per epoch by jabas's planner (``planner.py``) on the time to
  finish predicted with the noise scale forecast (``forecast.py``); until three
  epochs' noise scales are measured, on the least expected regret over a band of
  noise scales instead (``forecast.regret``: the first epochs' understate it).
- ``jabas-similarity``: the same with jabas's ``similarity`` GBS policy instead of
  goodput (its expectation derived from the statistics, ``similarity.py``): the
  GBS follows the rule, and each allocation runs its fastest configuration
  within 5% of that GBS.
- ``oracle``: perfect hindsight: with the true statistics of every epoch, each
  allocation's goodput-optimal IIDP configuration per epoch, and the sequence of
  allocations of least total time, moves included (dynamic programming over
  epochs). A lower bound on ``jabas``'s time in this model; cost is not its goal.
  It alone sees the true gain (the trace's credit, ``progress.py``).

What the adaptive policies know: at the start of epoch ``k`` they have measured
the statistics of epoch ``k - 1`` at the GBS they ran (epoch 0: the first epoch's,
which AdaptDL measures in its first iterations; the trace has nothing earlier),
and they extrapolate ``E(M)`` from that one measurement (the formula on the
statistics, without the credit).
"""

from __future__ import annotations

import itertools

import numpy as np

from jabascli.errors import InputError
from jabascli.simulate import forecast, similarity
from jabascli.simulate.configs import Allocation, Config, Frontier, Timing, describe
from jabascli.simulate.loop import Decide, PolicyResult, run_policy
from jabascli.simulate.planner import OBJECTIVES, TraceSpace, choose_allocation
from jabascli.simulate.progress import Statistics
from jabascli.simulate.steptime import StepTimes
from jabascli.simulate.trace import Trace

BASELINES = ("fixed", "ddp-all", "pollux")
POLICIES = ("fixed", "ddp-all", "pollux", "jabas", "jabas-similarity", "oracle")


class Simulation:
    """One trace on one cluster: the shared model every policy runs against."""

    def __init__(
        self,
        trace: Trace,
        cluster: dict[str, int],
        prices: dict[str, float],
        target_metric: float | None = None,
        objective: str = "time",
    ) -> None:
        self.trace = trace
        self.cluster = cluster
        self.prices = prices
        self.stats = Statistics(trace.validation)
        steps = {t: StepTimes(trace.timings[t]) for t in cluster}
        self.timing = Timing(steps, tuple(float(b) for b in trace.batch_sizes))
        self.per_node = self.timing.per_node
        self.target_metric = target_metric
        if objective not in OBJECTIVES:
            raise InputError.at(
                None, "objective", f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVES)}"
            )
        self.objective = objective
        # The epochs the job is planned for: to the target (Statistics.target_epoch) or the trace's end.
        self.horizon = self.stats.epochs
        if target_metric is not None:
            self.stats.check_target(target_metric)
            self.horizon = self.stats.target_epoch(target_metric) + 1

    # -- helpers ---------------------------------------------------------------

    def run(self, name: str, decide: Decide) -> PolicyResult:
        return run_policy(
            name, decide, self.stats, self.prices, self.per_node, self.trace.restart_s, self.target_metric
        )

    def gpu_counts(self, gpu_type: str) -> list[int]:
        """GPU counts offered on one type: powers of two below a node, then whole nodes."""
        per_node, nodes = self.per_node[gpu_type], self.cluster[gpu_type]
        small = [g for g in (1, 2, 4) if g < per_node]
        return small + [per_node * n for n in range(1, nodes + 1)]

    def node_allocations(self) -> list[Allocation]:
        """Every non-empty choice of whole nodes per type (jabas's allocation unit is a node)."""
        types = list(self.cluster)
        out = []
        for counts in itertools.product(*(range(self.cluster[t] + 1) for t in types)):
            if any(counts):
                out.append(tuple((t, n * self.per_node[t]) for t, n in zip(types, counts, strict=True) if n))
        return out

    def _seen_row(self, epoch: int, oracle: bool) -> int:
        return epoch if oracle else max(epoch - 1, 0)

    def _rate(self, frontier: Frontier, epoch: int, gbs: float | None, oracle: bool) -> tuple[int, float]:
        """Best goodput point of ``frontier`` as the policy sees it, and its progress rate (/s)."""
        row = self._seen_row(epoch, oracle)
        if oracle:  # the true gain, credit included
            eff = np.asarray(self.stats.gain(frontier.gbs, row)) * self.stats.m0 / frontier.gbs
        else:
            eff = np.asarray(self.stats.efficiency(frontier.gbs, row, stats_gbs=gbs or self.stats.m0))
        i = frontier.best_goodput(eff)
        return i, float(eff[i] * frontier.gbs[i] / self.stats.m0 / frontier.iter_s[i])

    def planned_end(self, epoch: int) -> int:
        """The epoch the job is planned to end with (exclusive): the horizon, or ``epoch + 1`` past it.

        Past the horizon the target is late; the job is planned one epoch at a time.
        """
        return max(self.horizon, epoch + 1)

    def remaining_progress(self, epoch: int) -> float:
        """Progress left from the start of ``epoch`` to the planned end: the horizon a move must pay off in."""
        start = self.stats.boundaries[epoch - 1] if epoch > 0 else 0.0
        return float(self.stats.boundaries[self.planned_end(epoch) - 1] - start)

    # -- policies --------------------------------------------------------------

    def fixed(self, batch_size: int) -> PolicyResult | None:
        best: PolicyResult | None = None
        for gpu_type in self.cluster:
            for gpus in self.gpu_counts(gpu_type):
                allocation: Allocation = ((gpu_type, gpus),)
                config = self.timing.uniform(allocation, float(batch_size))
                if config is None:
                    continue
                result = self.run(f"fixed-{batch_size}", lambda *_, a=allocation, c=config: (a, c))
                result.details = {"batch_size": batch_size, "allocation": describe(allocation, self.per_node)}
                if best is None or (result.time_s, result.cost) < (best.time_s, best.cost):
                    best = result
        return best

    def ddp_all(self) -> PolicyResult | None:
        allocation: Allocation = tuple((t, n * self.per_node[t]) for t, n in self.cluster.items())
        best: PolicyResult | None = None
        for batch_size in self.trace.batch_sizes:
            config = self.timing.uniform(allocation, float(batch_size))
            if config is None:
                continue
            result = self.run("ddp-all", lambda *_, c=config: (allocation, c))
            result.details = {"batch_size": batch_size, "allocation": describe(allocation, self.per_node)}
            if best is None or (result.time_s, result.cost) < (best.time_s, best.cost):
                best = result
        return best

    def pollux(self) -> PolicyResult | None:
        best: PolicyResult | None = None
        for gpu_type in self.cluster:
            options = [((gpu_type, g),) for g in self.gpu_counts(gpu_type)]
            frontiers = {a: self.timing.frontier(a, self.stats.m0, self.stats.max_gbs) for a in options}
            frontiers = {a: f for a, f in frontiers.items() if f is not None}
            if not frontiers:
                continue

            def decide(
                epoch: int, current: Allocation | None, gbs: float | None, fr: dict[Allocation, Frontier] = frontiers
            ) -> tuple[Allocation, Config]:
                work = self.remaining_progress(epoch)
                scored = {a: self._rate(f, epoch, gbs, oracle=False) for a, f in fr.items()}
                choice = max(scored, key=lambda a: scored[a][1])
                if current in scored and work / scored[current][1] <= work / scored[choice][1] + self.trace.restart_s:
                    choice = current  # the gain does not pay for the restart
                return choice, fr[choice].config(scored[choice][0])

            result = self.run("pollux", decide)
            result.details = {"gpu_type": gpu_type}
            if best is None or (result.time_s, result.cost) < (best.time_s, best.cost):
                best = result
        return best

    def jabas_allocations(self) -> list[Allocation]:
        """jabas's candidates: whole nodes of any types, and every single-type choice pollux has.

        So jabas can always pick what pollux would (1, 2 or 4 GPUs of one node too).
        """
        single = [((t, g),) for t in self.cluster for g in self.gpu_counts(t)]
        return list(dict.fromkeys(self.node_allocations() + single))

    def _node_frontiers(self) -> dict[Allocation, Frontier]:
        frontiers = {a: self.timing.frontier(a, self.stats.m0, self.stats.max_gbs) for a in self.jabas_allocations()}
        return {a: f for a, f in frontiers.items() if f is not None}

    def _near(self, frontier: Frontier, epoch: int, gbs: float | None, target: float) -> tuple[int, float]:
        """The fastest point of ``frontier`` within 5% of GBS ``target`` (else the nearest), and its rate."""
        eff = np.asarray(self.stats.efficiency(frontier.gbs, self._seen_row(epoch, False), gbs or self.stats.m0))
        off = np.abs(frontier.gbs - target) / target
        close = off <= max(0.05, float(off.min()))
        i = int(np.flatnonzero(close)[np.argmin(frontier.iter_s[close])])
        return i, float(eff[i] * frontier.gbs[i] / self.stats.m0 / frontier.iter_s[i])

    def jabas(self, batching: str = "goodput") -> PolicyResult | None:
        """jabas with its ``goodput`` or ``similarity`` GBS policy (``similarity.py``).

        Each epoch, every candidate allocation is predicted the time to finish the
        job: with ``goodput``, at its goodput-optimal configuration of each remaining
        epoch for the noise scale forecast from those measured so far
        (``forecast.py``); with ``similarity``, at the GBS the rule asks for now.
        The planner (``planner.choose_allocation``) picks one. While the statistics are unsettled
        (``forecast.settled``) the goodput policy plans on its regret over a band of
        noise scales instead (:meth:`_least_regret`, ``forecast.robust_point``),
        the first allocation's near-ties decided at the band's top
        (``planner.first_placement``). Once settled, a move must also clear the margin with the forecast scaled
        by the forecast's measured error (``forecast.ForecastError``,
        ``planner.uncertain_margin``).
        """
        frontiers = self._node_frontiers()
        if not frontiers:
            return None
        rate_at = (
            {a: forecast.RateCurve(f, self.stats.m0) for a, f in frontiers.items()} if batching == "goodput" else {}
        )
        space = TraceSpace(list(frontiers), list(self.cluster), self.prices)
        measured: dict[int, float] = {}  # by the epoch (trace row) the statistics are of
        error = forecast.ForecastError()
        epoch_work = np.diff(self.stats.boundaries, prepend=0.0)

        def decide(epoch: int, current: Allocation | None, gbs: float | None) -> tuple[Allocation, Config]:
            work = self.remaining_progress(epoch)
            points: dict[Allocation, int] = {}
            time_s: dict[Allocation, float] = {}
            target = 0.0
            now = gbs or self.stats.m0
            row = self._seen_row(epoch, False)
            noise = self.stats.noise_scale(now, row)
            measured[row] = noise  # epochs 0 and 1 both see the first epoch's: one measurement
            error.measured(row, noise)
            end = self.planned_end(epoch)
            future = forecast.noise_scales(list(measured.values()), end - epoch)
            uncertain: list[dict[Allocation, float]] = []
            if batching == "similarity":
                iterations = self.stats.epoch_progress(epoch) * self.stats.m0 / now
                target = similarity.next_gbs(now, noise, iterations, low=self.stats.m0, high=self.stats.max_gbs)
            robust = batching == "goodput" and not forecast.settled(list(measured.values()))
            error.forecast(epoch, float(future[0]), trend=not robust)
            band = forecast.scenarios(noise, self.stats.max_gbs)
            for allocation, frontier in frontiers.items():
                if batching == "similarity":
                    i, rate = self._near(frontier, epoch, gbs, target)
                    time_s[allocation] = work / rate
                elif robust:
                    i = forecast.robust_point(frontier, self.stats.m0, band)
                else:
                    i, _ = self._rate(frontier, epoch, gbs, oracle=False)
                    time_s[allocation] = float(np.sum(epoch_work[epoch:end] / rate_at[allocation](future)))
                    if error.sigma > 0:  # the same at the ends of the forecast's uncertainty
                        if not uncertain:
                            uncertain = [{}, {}]
                        for times, sign in zip(uncertain, (-1.0, 1.0), strict=True):
                            scaled = future * np.exp(sign * error.sigma)
                            times[allocation] = float(np.sum(epoch_work[epoch:end] / rate_at[allocation](scaled)))
                points[allocation] = i
            move_s = self.trace.restart_s
            top: dict[Allocation, float] | None = None
            if robust:
                time_s, top = self._least_regret(list(frontiers), current, epoch_work[epoch:end], future, band, rate_at)
                move_s = 0.0  # charged in every scenario already
            chosen = choose_allocation(
                space, time_s, current, move_s, objective=self.objective, uncertain=uncertain, tie_break=top
            )
            return chosen, frontiers[chosen].config(points[chosen])

        return self.run("jabas" if batching == "goodput" else f"jabas-{batching}", decide)

    def _least_regret(
        self,
        allocations: list[Allocation],
        current: Allocation | None,
        work: np.ndarray,
        future: np.ndarray,
        band: np.ndarray,
        rate_at: dict[Allocation, forecast.RateCurve],
    ) -> tuple[dict[Allocation, float], dict[Allocation, float]]:
        """Each allocation's time to finish while the statistics are unsettled: its regret over ``band``.

        ``T_a(s)``: the forecast scaled to scenario ``s`` (``future * s / band[0]``),
        plus the restart for a move; an allocation's planning time is
        ``exp(mean_s log(T_a(s) / min_b T_b(s)))`` (``forecast.regret``) times the
        least time at the measurement, so the planner keeps its margin rule on a
        time-like value. Also each allocation's ``T_a`` at the band's top, which
        breaks a first allocation's near-ties (rule 7, ``planner.first_placement``).
        """
        times = np.array(
            [
                [
                    float(np.sum(work / rate_at[a](future * s / band[0])))
                    + (self.trace.restart_s if current is not None and a != current else 0.0)
                    for s in band
                ]
                for a in allocations
            ]
        )
        regret = np.exp(forecast.regret(times, higher_is_better=False))
        scale = float(times[:, 0].min())
        planning = {a: float(r * scale) for a, r in zip(allocations, regret, strict=True)}
        return planning, {a: float(t) for a, t in zip(allocations, times[:, -1], strict=True)}

    def oracle(self) -> PolicyResult | None:
        frontiers = self._node_frontiers()
        if not frontiers:
            return None
        allocations = list(frontiers)
        epochs = self.stats.epochs
        times = np.empty((epochs, len(allocations)))
        points = np.empty((epochs, len(allocations)), dtype=int)
        for k in range(epochs):
            for j, allocation in enumerate(allocations):
                i, rate = self._rate(frontiers[allocation], k, None, oracle=True)
                points[k, j] = i
                times[k, j] = self.stats.epoch_progress(k) / rate
        # total[j]: least time to the end of epoch k, ending on allocation j; to the horizon
        # (the target's epoch), then on the last allocation should the target come later
        total = times[0].copy()
        came_from = np.zeros((epochs, len(allocations)), dtype=int)
        came_from[:] = np.arange(len(allocations))
        for k in range(1, self.horizon):
            best = int(np.argmin(total))
            move = total[best] + self.trace.restart_s
            stay = total <= move
            came_from[k] = np.where(stay, np.arange(len(allocations)), best)
            total = np.where(stay, total, move) + times[k]
        path = [int(np.argmin(total))]
        for k in range(epochs - 1, 0, -1):  # came_from[k] is the identity past the horizon
            path.append(int(came_from[k, path[-1]]))
        path.reverse()

        def decide(epoch: int, current: Allocation | None, gbs: float | None) -> tuple[Allocation, Config]:
            allocation = allocations[path[epoch]]
            return allocation, frontiers[allocation].config(int(points[epoch, path[epoch]]))

        return self.run("oracle", decide)


def run_policies(sim: Simulation, policies: list[str]) -> list[PolicyResult]:
    """Run the named policies (``fixed`` = every traced GBS, or ``fixed-<B>``)."""
    results: list[PolicyResult] = []
    for name in policies:
        if name == "fixed":
            found = [sim.fixed(b) for b in sim.trace.batch_sizes]
        elif name.startswith("fixed-"):
            size = name.removeprefix("fixed-")
            if not size.isdigit() or int(size) not in sim.trace.batch_sizes:
                raise InputError.at(
                    None, "policies", f"{name}: expected fixed-<B> with B one of {sim.trace.batch_sizes}"
                )
            found = [sim.fixed(int(size))]
        elif name == "ddp-all":
            found = [sim.ddp_all()]
        elif name == "pollux":
            found = [sim.pollux()]
        elif name == "jabas":
            found = [sim.jabas()]
        elif name == "jabas-similarity":
            found = [sim.jabas("similarity")]
        elif name == "oracle":
            found = [sim.oracle()]
        else:
            raise InputError.at(None, "policies", f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
        results.extend(r for r in found if r is not None)
    if not results:
        raise InputError.at(
            None, "cluster", "too small for the trace: no configuration reaches the smallest traced batch size"
        )
    return results
