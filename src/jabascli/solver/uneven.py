"""Uneven plans: every GPU one micro-batch of its own size, balanced to its speed (issue #35).

IIDP gives every micro-batch the same LBS, so a GBS splits across servers only
in whole-LBS steps; a speed ratio such as 1.6 : 1 then needs many small
micro-batches, each paying its fixed costs. An *uneven plan* gives rank ``r``
one micro-batch of ``b_r`` samples per iteration (VSW 1, GA 0) with
``sum_r b_r = GBS``, the sizes balanced to the ranks' speeds, as AdaptDL and
uneven-batch DDP do; the engine weights each micro-batch's mean loss by
``b_r / GBS``, so it is the same synchronous SGD (docs/engine.md).

Per rank, under the performance model (:mod:`jabascli.perfmodel`, one VSW)::

    f_r(b) = min over g >= 0 with (g + 1) | b, lo_r <= b / (g + 1) <= hi_r  of  T_r(LBS b / (g + 1), v = 1, GA g)

``[lo_r, hi_r]`` is the rank's profiled LBS range (an LBS between two profiled
ones is predicted on the chord of their times, ``PerformanceModel.device``):
a share too large for memory trains as ``g + 1`` equal micro-batches (GA).
The plan minimises the slowest rank::

    min over (b_r), sum_r b_r = GBS  of  max_r f_r(b_r)

Search: start from shares proportional to each rank's predicted samples/s
(``b / f_r(b)`` at a share within its profiled range), fill or trim to the GBS
one feasible size at a time (filling where the time after is smallest,
trimming where it is largest), then move samples from a slowest rank to the
rank whose time after taking them is smallest while both end below the current
maximum. That stops at the optimum when every ``f_r`` is non-decreasing and
defined on a contiguous range of sizes (a single-sample move then always exists
when the maximum can drop); gaps (a prime share above ``hi_r``) only make it a
good plan rather than the best. The GPUs of an allocation unit take the same
size; with ``--servers auto`` every non-empty set of whole server types is
tried, ranked like IIDP's allocations (:func:`~jabascli.solver.cluster.allocation_key`),
and the weight sync is chosen among the solver's methods. The plan is offered
only when it is uneven (some sizes differ); an even split is an IIDP plan.

Where the model finds GA's many small micro-batches about as fast as one large
one, the best ``f_r`` often splits every share into micro-batches of one LBS:
an IIDP plan again. So the search also runs with one micro-batch per GPU
wherever it fits (the fewest GA steps, ``RankCosts(fewest_steps=True)``: what
uneven-batch DDP trains). The GA split is offered instead only when predicted
faster by more than :data:`GA_SPLIT_MARGIN`: on one device, GA's micro-batches
train the same samples one after another, and a profile that makes small ones
look cheaper per sample is usually noise (ViT, 1.5x, GBS 256 on this 2-core
host: 19 micro-batches of 8 on the fast server predicted 257 ms, 7% below one
micro-batch each, and measured 300 ms, where uneven-batch DDP's one micro-batch
each measured 246 ms).
The model's error then decides through ``jabas run``'s runner-up trial
(:mod:`jabascli.cli.trial`) instead of a guess.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from jabascli.errors import InputError
from jabascli.perfmodel import WEIGHT_SYNC_METHODS, Allocation, BucketTimes, PerformanceModel, ServerSpec
from jabascli.perfmodel import WeightSyncMethod as WS
from jabascli.solver.cluster import UnitGroup, allocation_key, server_types, whole_servers
from jabascli.solver.plan import Assignment, Plan
from jabascli.solver.solve import Solver

MAX_TYPE_SUBSETS = 63
"""``--servers auto``: the most sets of server types tried (more types: every server only)."""
MAX_MOVES = 100_000
GA_SPLIT_MARGIN = 0.10
"""How much faster (a fraction) a split of shares into GA micro-batches must be predicted than one micro-batch
per GPU to be offered instead: about the offline model's error on CPU hosts before a refit (the module doc)."""


class RankCosts:
    """``f(b)`` of one GPU of a profiled server, its GA, cached (the module doc)."""

    def __init__(
        self, model: PerformanceModel, profile_server: str, ws: WS, buckets: BucketTimes, fewest_steps: bool = False
    ) -> None:
        self.model, self.profile_server, self.ws, self.buckets = model, profile_server, ws, buckets
        self.fewest_steps = fewest_steps
        """Only the fewest micro-steps ``b`` fits in (one, where ``b`` is within the profiled LBS range)."""
        values = model.lbs_values(profile_server)
        self.lo, self.hi = (values[0], values[-1]) if values else (1, 0)
        self._cache: dict[int, tuple[float, int]] = {}

    def __call__(self, b: int) -> tuple[float, int]:
        """``(f(b), g)``: the predicted time and GA of ``b`` samples per iteration (``inf``: none fits)."""
        cached = self._cache.get(b)
        if cached is not None:
            return cached
        best = (math.inf, 0)
        if b >= self.lo:
            for steps in range(max(1, -(-b // self.hi)), b // self.lo + 1):
                if b % steps:
                    continue
                try:
                    device = self.model.device(self.profile_server, b // steps)
                except InputError:
                    continue  # an LBS in the range whose memory profile says it does not fit
                time = float(self.model.iteration_times(device, 1, steps - 1, self.ws, self.buckets))
                if time < best[0]:  # strict: the fewest GA steps among equally fast ones
                    best = (time, steps - 1)
                if self.fewest_steps:
                    break
        self._cache[b] = best
        return best

    def time(self, b: int) -> float:
        return self(b)[0]

    def next_size(self, b: int, most: int) -> int | None:
        """The smallest feasible size in ``b + 1 .. b + most``."""
        return next((x for x in range(b + 1, b + most + 1) if math.isfinite(self.time(x))), None)

    def previous_size(self, b: int, most: int) -> int | None:
        """The largest feasible size in ``b - most .. b - 1``."""
        return next((x for x in range(b - 1, max(b - most, self.lo) - 1, -1) if math.isfinite(self.time(x))), None)


def balance(costs: Sequence[RankCosts], total: int) -> list[int] | None:
    """Sizes ``b_u`` (one per cost function) with ``sum b_u == total`` minimising ``max f_u(b_u)``; None: none."""
    n = len(costs)
    if n == 0 or any(c.lo > c.hi for c in costs) or sum(c.lo for c in costs) > total:
        return None
    refs = [min(c.hi, max(c.lo, total // n)) for c in costs]
    speeds = [r / c.time(r) for c, r in zip(costs, refs, strict=True)]
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        return None
    sizes = []
    for c, s in zip(costs, speeds, strict=True):
        share = max(c.lo, int(total * s / sum(speeds)))
        sizes.append(share if math.isfinite(c.time(share)) else (c.previous_size(share, share) or c.lo))
    while (left := total - sum(sizes)) != 0:
        if left > 0:  # fill where the time after is smallest
            steps = [(c.time(x), u, x) for u, c in enumerate(costs) if (x := c.next_size(sizes[u], left)) is not None]
            pick = min(steps, default=None)
        else:  # trim where the time now is largest
            steps = [
                (-c.time(sizes[u]), u, x)
                for u, c in enumerate(costs)
                if (x := c.previous_size(sizes[u], -left)) is not None
            ]
            pick = min(steps, default=None)
        if pick is None:
            return None
        sizes[pick[1]] = pick[2]
    for _ in range(MAX_MOVES):
        times = [c.time(b) for c, b in zip(costs, sizes, strict=True)]
        top = max(times)
        slow = times.index(top)
        smaller = costs[slow].previous_size(sizes[slow], sizes[slow])
        if smaller is None or costs[slow].time(smaller) >= top:
            return sizes
        moved = sizes[slow] - smaller
        after = [(costs[u].time(sizes[u] + moved), u) for u in range(n) if u != slow]
        best = min(after, default=(math.inf, -1))
        if not best[0] < top:
            return sizes
        sizes[slow], sizes[best[1]] = smaller, sizes[best[1]] + moved
    return sizes


def uneven_plan(
    model: PerformanceModel,
    groups: Sequence[UnitGroup],
    allocation_unit: int,
    ws: WS,
    gbs: int,
    cache: dict[tuple[str, WS, BucketTimes, bool], RankCosts] | None = None,
    fewest_steps: bool = False,
) -> Plan | None:
    """The balanced uneven plan for ``gbs`` on the units of ``groups``; None when none is uneven and reaches it.
    ``fewest_steps``: each GPU's share in as few micro-batches as fit (one, within the profiled range)."""
    if gbs % allocation_unit:
        return None
    cache = {} if cache is None else cache
    units: list[ServerSpec] = [g.server for g in groups for _ in range(g.units)]
    buckets = model.bucket_times(Allocation.of((g.server, g.units * allocation_unit) for g in groups))
    costs = []
    for spec in units:
        key = (spec.profile_server, ws, buckets, fewest_steps)
        if key not in cache:
            cache[key] = RankCosts(model, spec.profile_server, ws, buckets, fewest_steps)
        costs.append(cache[key])
    sizes = balance(costs, gbs // allocation_unit)
    if sizes is None or len(set(sizes)) < 2:
        return None
    assignments: list[Assignment] = []
    start = 0
    for _, run in itertools.groupby(range(len(units)), key=lambda u: (units[u].name, sizes[u])):
        count = len(list(run))
        spec, b = units[start], sizes[start]
        time, ga = costs[start](b)
        assignments.append(Assignment(spec.name, spec.device_type, count * allocation_unit, 1, ga, time, b // (ga + 1)))
        start += count
    time_s = max(a.iteration_time_s or 0.0 for a in assignments)
    if not (math.isfinite(time_s) and time_s > 0):
        return None
    plan = Plan(gbs, min(a.lbs or 0 for a in assignments), ws, time_s, gbs / time_s, tuple(assignments))
    return plan if plan.uneven else None


def candidate_allocations(solver: Solver) -> list[tuple[UnitGroup, ...]]:
    """Every server (``solver.auto`` false), else every non-empty set of whole server types."""
    unit = solver.allocation_unit
    types = server_types(solver.servers, unit)
    if not solver.auto or 2 ** len(types) - 1 > MAX_TYPE_SUBSETS:
        return [whole_servers(solver.servers, unit)]
    return [
        tuple(g for t in chosen for g in t.take(t.units))
        for k in range(1, len(types) + 1)
        for chosen in itertools.combinations(types, k)
    ]


def best_uneven_plan(solver: Solver, gbs: int) -> Plan | None:
    """The fastest uneven plan for ``gbs`` on ``solver``'s servers and weight-sync methods: one micro-batch per
    GPU, or the GA-free search's where it is predicted faster by more than :data:`GA_SPLIT_MARGIN` (the module
    doc); None when neither reaches ``gbs``."""
    single = _fastest(solver, gbs, fewest_steps=True)
    split = _fastest(solver, gbs, fewest_steps=False)
    if single is None or split is None:
        return single or split
    assert single.iteration_time_s is not None and split.iteration_time_s is not None
    return split if split.iteration_time_s < single.iteration_time_s * (1 - GA_SPLIT_MARGIN) else single


def _fastest(solver: Solver, gbs: int, fewest_steps: bool) -> Plan | None:
    best: tuple[tuple[float, int, int], Plan] | None = None
    cache: dict[tuple[str, WS, BucketTimes, bool], RankCosts] = {}
    for groups, ws in itertools.product(candidate_allocations(solver), solver.methods):
        plan = uneven_plan(solver.model, groups, solver.allocation_unit, ws, gbs, cache, fewest_steps)
        if plan is None or plan.iteration_time_s is None:
            continue
        key = (*allocation_key(plan.iteration_time_s, plan.gpus), WEIGHT_SYNC_METHODS.index(ws))
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1] if best is not None else None
