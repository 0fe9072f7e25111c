"""From a target GBS to a plan for the job's current ranks (same world size, same servers).

``direction`` is +1 (grow), -1 (shrink) or 0 (nearest either way). The chosen
GBS is, among those reachable within ``[gbs_min, gbs_max]`` (and at most the
training set) and strictly beyond the current GBS in ``direction``, the one
nearest the target.

* **Solver** (profiles for every device type): the fastest plan the solver
  finds for each reachable GBS (:meth:`Solver.solve_range`), for the same
  servers in the same rank order; its LBS may differ from the current one.
* **Hybrid planner** (a job with ``[parallel] plan = "auto"`` and hybrid profiles): the hybrid planner's fastest
  plan for each GBS of ``jabas solve --hybrid --range LOW:HIGH`` (:func:`jabascli.hybrid.job.solve_range`, the
  same code: ``LOW, 2 LOW, 4 LOW ... HIGH``) on the job's servers. Its LBS, micro-batch counts *and layout*
  (``[parallel]``) may differ from the current plan's; a plan that leaves one of the job's ranks idle, or that
  would put a pipeline stage's rank on another server than the one it runs on, is not reachable in place and is
  left out (:func:`in_layout_order`), as is a layout the trainer refuses for the job's config (:func:`refused`).
  A new layout is applied by the engine's relayout (:mod:`jabascli.engine.relayout`), micro-batch counts and LBS
  in place.
* **Fallback** (no profiles): keep LBS and use ``W' = GBS' / LBS`` workers,
  spread over the ranks in proportion to the ``VSW * (GA + 1)`` of the job's
  *starting* plan (largest remainder, ties to the lower rank, at least one
  each). The starting plan says how fast the devices are relative to each
  other; the current one may have lost that (after shrinking to one worker per
  rank, every rank looks alike). A rank with ``n`` workers takes the largest
  VSW not above its starting VSW that divides ``n`` and the rest as GA (GA
  before VSW: memory is unknown). When the target is below one worker per rank
  at this LBS, a smaller LBS with one worker per rank is used instead.

Both are deterministic functions of their inputs, so every rank that computes
one gets the same plan; the engine still has rank 0 decide and broadcast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jabascli.config.models import ParallelConfig
from jabascli.engine.plan import RankPlan, TrainingPlan


@dataclass(frozen=True)
class Candidate:
    plan: TrainingPlan
    throughput: float | None = None
    """Predicted samples per second (solver plans only)."""


def spread(workers: int, weights: Sequence[int]) -> list[int] | None:
    """``workers`` split over ranks in proportion to ``weights`` (largest remainder), at least one each.

    None when there are fewer workers than ranks. A rank rounded down to 0
    takes one worker from the rank with the most.
    """
    n = len(weights)
    if workers < n:
        return None
    total = sum(weights)
    exact = [workers * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: workers - sum(counts)]:
        counts[i] += 1
    for i in range(n):
        if counts[i] == 0:
            donor = max(range(n), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] = 1
    return counts


def rank_shape(workers: int, current_vsw: int) -> tuple[int, int]:
    """(VSW, GA) for ``workers`` micro-steps: the largest VSW <= the current one dividing it; GA the rest."""
    vsw = max(d for d in range(1, min(current_vsw, workers) + 1) if workers % d == 0)
    return vsw, workers // vsw - 1


def with_workers(plan: TrainingPlan, lbs: int, counts: Sequence[int], start: TrainingPlan) -> TrainingPlan:
    ranks = []
    for r, n, s in zip(plan.ranks, counts, start.ranks, strict=True):
        vsw, ga = rank_shape(n, s.vsw)
        ranks.append(dataclasses.replace(r, vsw=vsw, ga=ga))
    return dataclasses.replace(plan, lbs=lbs, ranks=tuple(ranks))


def fallback_candidates(plan: TrainingPlan, low: int, high: int, start: TrainingPlan | None = None) -> list[Candidate]:
    """Every GBS the fallback reaches in ``[low, high]``: keep LBS, or shrink it to one worker per rank."""
    start = start or plan
    out: list[Candidate] = []
    weights = [r.micro_steps for r in start.ranks]
    n = plan.world_size
    for lbs in range(1, plan.lbs):  # smaller LBS: one worker per rank
        if low <= lbs * n <= high:
            out.append(Candidate(with_workers(plan, lbs, [1] * n, start)))
    first, last = max(n, math.ceil(low / plan.lbs)), high // plan.lbs
    # The whole range could be long: candidates near any target are what matters, and these are cheap.
    for w in range(first, last + 1):
        counts = spread(w, weights)
        if counts is not None:
            out.append(Candidate(with_workers(plan, plan.lbs, counts, start)))
    return out


def choose(candidates: Sequence[Candidate], current: int, target: float, direction: int) -> Candidate | None:
    """The candidate nearest ``target`` strictly beyond ``current`` in ``direction`` (any side when 0)."""
    if direction > 0:
        pool = [c for c in candidates if c.plan.gbs > current]
    elif direction < 0:
        pool = [c for c in candidates if c.plan.gbs < current]
    else:
        pool = list(candidates)
    if not pool:
        return None
    return min(pool, key=lambda c: (abs(c.plan.gbs - target), c.plan.gbs))


def same_ranks(a: TrainingPlan, b: TrainingPlan) -> bool:
    return a.world_size == b.world_size and all(x.server == y.server for x, y in zip(a.ranks, b.ranks, strict=True))


def keep_rank_details(current: TrainingPlan, new: TrainingPlan, new_layout: bool = False) -> TrainingPlan:
    """``new``'s LBS and (VSW, GA) on ``current``'s ranks (emulation, device types, weight sync, file), under
    ``current``'s layout, or ``new``'s with ``new_layout`` (the hybrid planner's plans carry their own)."""
    ranks: list[RankPlan] = [
        dataclasses.replace(r, vsw=n.vsw, ga=n.ga) for r, n in zip(current.ranks, new.ranks, strict=True)
    ]
    parallel = new.parallel if new_layout else current.parallel
    return dataclasses.replace(current, lbs=new.lbs, ranks=tuple(ranks), parallel=parallel)


class Replanner:
    """Candidate plans for the job's ranks: the hybrid planner's or the solver's when profiles allow, else the
    fallback's."""

    def __init__(
        self,
        solver_plans: list[Candidate] | None,
        low: int,
        high: int,
        start: TrainingPlan,
        hybrid: bool = False,
    ) -> None:
        self.solver_plans = solver_plans
        self.low, self.high = low, high
        self.start = start
        """The job's starting plan: the fallback's proportions and VSW limits."""
        self.hybrid = hybrid
        """``solver_plans`` are the hybrid planner's: each carries its own layout (``parallel``)."""

    @property
    def source(self) -> str:
        if self.solver_plans is None:
            return "fallback"
        return "hybrid planner" if self.hybrid else "solver"

    def candidates(self, plan: TrainingPlan) -> list[Candidate]:
        if self.solver_plans is not None:
            return [Candidate(keep_rank_details(plan, c.plan, self.hybrid), c.throughput) for c in self.solver_plans]
        return fallback_candidates(plan, self.low, self.high, self.start)

    def plan_for(self, plan: TrainingPlan, target: float, direction: int) -> Candidate | None:
        return choose(self.candidates(plan), plan.gbs, target, direction)

    def layout_at(self, gbs: int, current: ParallelConfig | None) -> ParallelConfig | None:
        """The layout of the plan chosen for ``gbs``: the hybrid planner's (one plan per GBS), else ``current``.

        Rank 0 broadcasts LBS and micro-batch counts only; every rank finds the layout here, from the same
        candidates (the planner is deterministic), so every rank applies the same plan."""
        if self.hybrid and self.solver_plans is not None:
            for c in self.solver_plans:
                if c.plan.gbs == gbs:
                    return c.plan.parallel
        return current


def solver_candidates(loaded: object, plan: TrainingPlan, low: int, high: int) -> list[Candidate] | None:
    """The solver's fastest plan for every reachable GBS in ``[low, high]`` on ``plan``'s ranks.

    None when the config has no usable profiles (the fallback applies then); empty when
    profiles exist but no plan of the range fits these ranks.
    """
    from jabascli.config import LoadedConfig
    from jabascli.engine.plan import plan_from_solver
    from jabascli.errors import JabasError
    from jabascli.solver import solver_from_config

    assert isinstance(loaded, LoadedConfig)
    servers = ",".join(dict.fromkeys(r.server for r in plan.ranks))
    try:
        # The plan's servers, not [cluster] available_servers: under the elastic runtime a job
        # moved to other servers keeps the config it started with.
        solver = solver_from_config(loaded, servers)
        plans = solver.solve_range(low, high)
    except (JabasError, OSError, ValueError):
        return None
    out = []
    for p in plans:
        try:
            candidate = in_rank_order(plan, plan_from_solver(p, "solver", loaded))
        except JabasError:
            continue
        if candidate is not None:
            out.append(Candidate(candidate, p.throughput))
    return out


def in_rank_order(current: TrainingPlan, new: TrainingPlan) -> TrainingPlan | None:
    """``new``'s (VSW, GA) given to ``current``'s ranks server by server (None if the servers differ).

    The solver orders its assignments its own way; a rank must stay on its server.
    """
    shapes: dict[str, list[tuple[int, int]]] = {}
    for r in new.ranks:
        shapes.setdefault(r.server, []).append((r.vsw, r.ga))
    ranks = []
    for r in current.ranks:
        queue = shapes.get(r.server)
        if not queue:
            return None
        vsw, ga = queue.pop(0)
        ranks.append(dataclasses.replace(r, vsw=vsw, ga=ga))
    if any(shapes.values()):
        return None
    return dataclasses.replace(current, lbs=new.lbs, ranks=tuple(ranks))


def hybrid_candidates(loaded: object, plan: TrainingPlan, low: int, high: int) -> list[Candidate] | None:
    """The hybrid planner's fastest plan for every GBS of ``--range low:high`` that runs on ``plan``'s ranks.

    None when the job's layout is not the planner's (``[parallel] plan = "auto"``) or it has no hybrid profiles
    (the other sources apply then). The same code as ``jabas solve --hybrid --range`` and ``jabas run``'s plan
    (:func:`jabascli.hybrid.job.solve`, :func:`~jabascli.hybrid.job.plan_file`), on the plan's servers; each
    GBS solved once per run (:mod:`jabascli.adaptive.hybrid_plans`).
    """
    from jabascli.adaptive.hybrid_plans import plans_for
    from jabascli.config import LoadedConfig
    from jabascli.engine.plan import plan_from_solver
    from jabascli.errors import JabasError

    assert isinstance(loaded, LoadedConfig)
    if not loaded.config.hybrid_auto:
        return None
    plans = plans_for(loaded, list(dict.fromkeys(r.server for r in plan.ranks)), low, high)
    if plans is None:
        return None
    out = []
    for found in plans:
        try:
            new = plan_from_solver(found, "hybrid planner", loaded)
        except JabasError:
            continue
        if new.parallel is None or refused(loaded, new.parallel):
            continue
        candidate = in_layout_order(plan, new)
        if candidate is not None:
            assert found.throughput is not None  # the planner's samples per second at its GBS
            out.append(Candidate(candidate, found.throughput))
    return out


def refused(loaded: object, parallel: ParallelConfig) -> bool:
    """Whether the trainer refuses ``parallel`` for this job's config (engine/parallel/runner.py's refusals that
    depend on the config alone): ``bf16`` with ``pp > 1``, ``fp16`` under any layout. Such a plan would stop the
    job at its relayout: it is no candidate."""
    from jabascli.config import LoadedConfig

    assert isinstance(loaded, LoadedConfig)
    precision = loaded.config.job.precision
    split = parallel.tp > 1 or parallel.pp > 1 or parallel.sharding != "none"
    return (precision == "bf16" and parallel.pp > 1) or (precision == "fp16" and split)


def in_layout_order(current: TrainingPlan, new: TrainingPlan) -> TrainingPlan | None:
    """``new`` (a hybrid plan) on ``current``'s ranks, each rank staying on its server; None if it cannot.

    Without pipeline stages every replica is one rank or one TP group of one server, so ranks take the new
    micro-batch counts server by server, in order (:func:`in_rank_order`); a TP group is ``tp`` consecutive ranks,
    which must share a server. With stages, the runtime gives rank ``k`` the
    ``k``-th place of the plan (replica by replica, stage by stage): the plan must name the same server there.
    """
    if new.parallel is None:
        return None
    t, ranks = new.parallel.tp, current.ranks
    if any(len({r.server for r in ranks[i : i + t]}) > 1 for i in range(0, len(ranks), t)):
        return None  # a TP group (t consecutive ranks) would span two servers
    if new.parallel.pp == 1:
        found = in_rank_order(current, new)
        return None if found is None else dataclasses.replace(found, parallel=new.parallel)
    if [r.server for r in new.ranks] != [r.server for r in current.ranks]:
        return None
    return keep_rank_details(current, new, new_layout=True)
