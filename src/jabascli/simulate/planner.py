"""The trace simulator's side of the auto-scaling planner (``autoscale/planner.py``).

At each epoch boundary the ``jabas`` policy predicts, for every candidate
allocation ``A``, the time ``T(A)`` to finish the job from here (``policies.py``:
its goodput-optimal IIDP configuration at the noise scale forecast for each
remaining epoch, or its regret over a band of noise scales while the statistics
are unsettled), and the one planner of jabas chooses: the same search, move
charge, objectives and margin rule as ``jabas run`` at an epoch end
(:class:`~jabascli.autoscale.planner.Planner`). Two adapters make the trace its
input:

- :class:`TraceSpace`: the candidate allocations as the planner's choices (GPUs
  per type, in the cluster's order; one GPU is the unit) with their prices;
- :class:`TraceCostModel`: the planner's ``IterationCostModel``, answering
  ``T(A)`` for a forecast of one segment of one unit of work (the whole rest
  of the job). The planner charges ``sum_k n_k * t(A, g_k)``, which assumes
  every allocation runs one GBS trajectory; on a trace each allocation runs
  its own goodput-optimal GBS (imagenet on Sia's cluster: GBS 10640 at 0.57 s
  per iteration on A100 + 2080 Ti where the A100s alone run 10240 at 0.85 s),
  so the time is predicted per allocation and handed over whole.

The horizon is the rest of the job (or to ``--target-metric``), not one epoch,
because an epoch can be far shorter than a move (CIFAR-10 on A100s: about 1 s
against a 50 s restart), so a one-epoch horizon never moves. The objectives map
onto the planner's:

- ``time``: the planner's ``time``;
- ``cost``: the planner's ``cost``;
- ``no-dearer``: the planner's ``time`` within a budget, the cost of the fastest
  *single-type* candidate (what Pollux would run), and a ``tie`` band of the
  margin: predictions that close are a tie the planner cannot resolve, so cost
  decides (CIFAR-10 on ``aws:2,rtx:1,azure:1``, where one RTX node and one V100
  node are predicted 0.5% apart at the start).

The margin (5%, as ``[scaling] margin``) keeps the current allocation unless
the best is better by more than it, the move's restart (the trace's) included.
A first allocation is no move; its near-ties (within the margin) are decided
by the predictions at the top of the band of noise scales instead
(:func:`first_placement`, rule 7 of docs/simulation.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from jabascli.autoscale.allocation import Choice
from jabascli.autoscale.planner import Objective, Planner
from jabascli.autoscale.trajectory import Segment
from jabascli.errors import InputError
from jabascli.simulate.configs import Allocation

DEFAULT_MARGIN = 0.05
OBJECTIVES = ("time", "cost", "no-dearer")
WHOLE_JOB = [Segment(0, 1)]
"""The forecast handed to the planner: one unit of work, priced by :class:`TraceCostModel` whole."""


class TraceSpace:
    """The candidate allocations of a traced cluster, as the planner's choices: GPUs per type."""

    def __init__(self, allocations: Sequence[Allocation], types: Sequence[str], prices: Mapping[str, float]) -> None:
        self.types = list(types)
        self.prices = [prices[t] for t in self.types]
        self._choices = list(dict.fromkeys(self.choice(a) for a in allocations))

    def choice(self, allocation: Allocation) -> Choice:
        gpus = dict(allocation)
        return tuple(gpus.get(t, 0) for t in self.types)

    def allocation(self, choice: Choice) -> Allocation:
        return tuple((t, g) for t, g in zip(self.types, choice, strict=True) if g)

    def count(self) -> int:
        return len(self._choices)

    def __iter__(self) -> Iterator[Choice]:
        return iter(self._choices)

    def check(self, choice: Choice) -> Choice:
        if tuple(choice) not in self._choices:
            raise InputError.at(None, "allocation", f"{self.allocation(choice)} is not a candidate")
        return tuple(choice)

    def gpus(self, choice: Choice) -> int:
        return sum(choice)

    def price_per_hour(self, choice: Choice) -> float:
        return sum(g * p for g, p in zip(choice, self.prices, strict=True))

    def single_type(self) -> list[Choice]:
        return [c for c in self._choices if sum(1 for g in c if g) == 1]


class TraceCostModel:
    """The planner's cost model on a trace: each candidate's predicted seconds to finish (module doc).

    ``iteration_time(choice, _)`` is the time of one unit of :data:`WHOLE_JOB`;
    a choice without a prediction cannot run (``inf``).
    """

    def __init__(self, space: TraceSpace, time_s: Mapping[Allocation, float]) -> None:
        self._time_s = {space.choice(a): t for a, t in time_s.items()}

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        return self._time_s.get(choice, float("inf"))


def choose_allocation(
    space: TraceSpace,
    time_s: Mapping[Allocation, float],
    current: Allocation | None,
    move_s: float,
    objective: str = "time",
    margin: float = DEFAULT_MARGIN,
    uncertain: Sequence[Mapping[Allocation, float]] = (),
    tie_break: Mapping[Allocation, float] | None = None,
) -> Allocation:
    """The allocation for the coming epoch: the planner's choice on the predicted times ``time_s``.

    ``move_s``: the restart a move costs (0 where ``time_s`` charges it already).
    ``uncertain``: the same predictions at the ends of the noise scale's uncertainty
    (``forecast.ForecastError``); a move must clear the margin at each of them
    (:func:`uncertain_margin`).
    ``tie_break``: for a first allocation, each candidate's time at the top of the
    noise-scale band, which decides its near-ties (:func:`first_placement`).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}")
    if tie_break is not None and current is None:
        time_s = first_placement(space, time_s, tie_break, objective, margin, move_s)
    tie, widened = margin, margin
    while True:
        chosen = _plan(space, time_s, current, move_s, objective, widened, tie)
        wider = uncertain_margin(chosen, current, time_s, uncertain, move_s, margin, space, objective)
        if wider <= widened:
            return chosen
        widened = wider


def first_placement(
    space: TraceSpace,
    time_s: Mapping[Allocation, float],
    top_s: Mapping[Allocation, float],
    objective: str,
    margin: float,
    move_s: float,
) -> dict[Allocation, float]:
    """Rule 7: a first allocation's near-ties are decided at the noise-scale band's top.

    ``time_s`` are the planning times of the unsettled statistics (the expected
    regret over the band of noise scales, ``policies.py:_least_regret``), ``top_s``
    each candidate's time to finish at the band's top. The noise scale grows as
    training proceeds, so the top is where the job spends its later epochs, and
    the settled forecast will favour the candidate fastest there: a near-tie in
    the mean regret, which the predictions cannot resolve, goes to the candidate
    that needs no later move (docs/simulation.md, rule 7). Returns the planner's
    input:

    - ``time``: the candidates within ``(1 + margin)`` of the least regret, each
      with its time at the top (the others get no prediction: the planner cannot
      choose them);
    - ``no-dearer``: the regrets, less the candidates more than the margin slower
      at the top than the fastest within the budget, so rule 3's tie to the
      cheaper admits only a tie at both; the single-type candidates stay, as the
      budget is theirs;
    - ``cost``: the regrets unchanged (the cheapest decides, rule 4).
    """
    if objective == "time":
        least = min(time_s.values())
        return {a: top_s[a] for a, t in time_s.items() if t <= (1 + margin) * least}
    if objective == "no-dearer":
        fastest = _plan(space, time_s, None, move_s, objective, margin, 0.0)
        limit = (1 + margin) * top_s[fastest]
        single = {space.allocation(c) for c in space.single_type()}
        return {a: t for a, t in time_s.items() if top_s[a] <= limit or a in single}
    return dict(time_s)


def uncertain_margin(
    chosen: Allocation,
    current: Allocation | None,
    time_s: Mapping[Allocation, float],
    uncertain: Sequence[Mapping[Allocation, float]],
    move_s: float,
    margin: float,
    space: TraceSpace,
    objective: str,
) -> float:
    """The margin a move from ``current`` to ``chosen`` must clear for its gain to hold in every scenario.

    With ``v`` the objective's value (time, or cost = time x price) and the move
    charged ``move_s``, the planner moves when ``v_new / v_cur < 1 - margin`` at the
    forecast; at a scenario ``s`` of ``uncertain`` the ratio is ``q_s``, so the move
    holds everywhere when ``q_0 < (1 - margin) * q_0 / max_s q_s``: the margin

        margin' = 1 - (1 - margin) * q_0 / max(q_0, max_s q_s)

    (``margin`` itself where no scenario is worse than the forecast, or there is no move).
    """
    if current is None or chosen == current or not uncertain:
        return margin
    price = {a: space.price_per_hour(space.choice(a)) for a in (chosen, current)}

    def ratio(times: Mapping[Allocation, float]) -> float:
        new, old = times[chosen] + move_s, times[current]
        return new * price[chosen] / (old * price[current]) if objective == "cost" else new / old

    q0 = ratio(time_s)
    worst = max([q0, *(ratio(times) for times in uncertain)])
    return 1 - (1 - margin) * q0 / worst


def _plan(
    space: TraceSpace,
    time_s: Mapping[Allocation, float],
    current: Allocation | None,
    move_s: float,
    objective: str,
    margin: float,
    tie: float,
) -> Allocation:
    """One call of the planner with the objective mapped as in the module doc (``tie``: no-dearer's band)."""
    cost_model = TraceCostModel(space, time_s)
    now = space.choice(current) if current is not None else None
    kind = "cost" if objective == "cost" else "time"
    plan = Objective(kind, margin=margin, move_downtime_s=move_s)
    single = space.single_type()
    if objective == "no-dearer" and single:
        estimates = [Planner(space, cost_model, plan).estimate(c, WHOLE_JOB, now) for c in single]
        budget = min(estimates, key=lambda e: (e.time_s, e.cost)).cost * (1 + 1e-9)
        plan = Objective("time", budget_per_epoch=budget, margin=margin, move_downtime_s=move_s, tie=tie)
    return space.allocation(Planner(space, cost_model, plan).plan(WHOLE_JOB, now).choice)
