"""The configuration solver: the fastest plan for a global batch size, exactly, under the model.

For one allocation, one LBS ``b`` and one weight-sync method, every unit of
``a`` GPUs picks (VSW ``v``, GA ``g``); it then holds ``a * v * (g + 1)``
workers and takes ``T(v, g)`` seconds per iteration (``perfmodel``). The plan
must hold exactly ``W = GBS / b`` workers, every GPU at least one, and the
iteration takes as long as its slowest unit. Counting workers per GPU
(``W / a``) and beyond the one every unit needs (``E = W / a - units``), a
unit given ``e`` extra workers costs at best

    cost[e] = min over v <= max_vsw(b) dividing e + 1 of T(v, (e + 1) / v - 1)

and the problem is the bottleneck knapsack solved exactly by
:class:`~jabascli.solver.bottleneck.BottleneckTable`, for all ``E`` at once.
The plan is the best over LBS values and weight-sync methods (and, with
``auto``, over allocations). Ties go to fewer GPUs, then ``sequential``, then
the larger LBS. See ``docs/solver.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jabascli.errors import InputError, Problem
from jabascli.perfmodel import (
    WEIGHT_SYNC_METHODS,
    Allocation,
    BucketTimes,
    GroupConfig,
    IterationPrediction,
    PerformanceModel,
    ServerSpec,
    WeightSyncMethod,
)
from jabascli.solver.bottleneck import BottleneckTable, FloatArray, IntArray
from jabascli.solver.cluster import (
    UnitGroup,
    allocation_key,
    allocations,
    check_allocation_unit,
    count_allocations,
    server_types,
    whole_servers,
)
from jabascli.solver.plan import Assignment, Plan

DDP_BUCKET_CAP_MIB = 25.0
INTERFERENCE_RATIO = 1.5
"""The seed's rule: buckets before the last averaging more than 1.5 x DDP's 25 MiB cap make the
overlapping optimizer slow down the all-reduce kernel, which the model cannot see."""

MAX_AUTO_ALLOCATIONS = 20_000


def weight_sync_methods(model: PerformanceModel, choice: str) -> tuple[WeightSyncMethod, ...]:
    """The methods the solver compares for ``choice`` (``recommend``, ``sequential`` or ``overlap``).

    ``recommend`` compares both by the model, except when there is no bucket
    profile (sequential only) or when the seed's interference rule rules
    ``overlap`` out.
    """
    if choice in WEIGHT_SYNC_METHODS:
        return (choice,)  # type: ignore[return-value]
    if choice != "recommend":
        raise InputError.at(None, "--weight-sync", f"expected recommend, sequential or overlap, got {choice!r}")
    buckets = model.comm.bucket_mib
    if buckets is None or len(buckets) < 2 or overlap_interferes(buckets):
        return ("sequential",)
    return ("sequential", "overlap")


def overlap_interferes(bucket_mib: Sequence[float]) -> bool:
    overlapped = bucket_mib[:-1]
    return bool(overlapped) and sum(overlapped) / len(overlapped) > INTERFERENCE_RATIO * DDP_BUCKET_CAP_MIB


@dataclass
class _Leaves:
    """Per unit type: ``cost[e]`` and the VSW count that attains it."""

    costs: list[FloatArray]
    vsw: list[IntArray]

    @property
    def size(self) -> int:
        return self.costs[0].size


class UnitCosts:
    """``cost[e]`` of one unit of a device type, and the VSW count that attains it; cached.

    The cache is shared by every allocation of a solver: allocations with the
    same all-reduce times (same GPU count and links) share their tables.
    """

    def __init__(self, model: PerformanceModel) -> None:
        self.model = model
        self._cache: dict[tuple[str, int, WeightSyncMethod, BucketTimes], tuple[FloatArray, IntArray]] = {}

    def __call__(
        self, profile_server: str, lbs: int, ws: WeightSyncMethod, buckets: BucketTimes, size: int
    ) -> tuple[FloatArray, IntArray]:
        key = (profile_server, lbs, ws, buckets)
        cached = self._cache.get(key)
        if cached is not None and cached[0].size >= size:
            return cached
        device = self.model.device(profile_server, lbs)
        cost = np.full(size, np.inf)
        vsw = np.zeros(size, dtype=np.int64)
        for v in range(1, device.max_vsw + 1):
            workers = np.arange(v, size + 1, v)  # a unit's workers per GPU: v * (g + 1)
            if not workers.size:
                break
            times = self.model.iteration_times(device, v, workers // v - 1, ws, buckets)
            slot = workers - 1
            better = times < cost[slot]  # strict: the fewest VSWs among equally fast choices
            cost[slot[better]] = times[better]
            vsw[slot[better]] = v
        self._cache[key] = (cost, vsw)
        return cost, vsw


@dataclass
class _Candidate:
    allocation: _FixedAllocation
    lbs: int
    weight_sync: WeightSyncMethod
    extra: int
    size: int
    """Extra-worker totals the tables are built for (>= ``extra + 1``), shared across a range."""
    time_s: float = field(default=np.inf)

    def key(self) -> tuple[float, int, int, int]:
        return (
            *allocation_key(self.time_s, self.allocation.gpus),
            WEIGHT_SYNC_METHODS.index(self.weight_sync),
            -self.lbs,
        )


class _FixedAllocation:
    """One allocation: its units grouped by device profiles, its all-reduce, its cached tables."""

    def __init__(
        self, model: PerformanceModel, groups: tuple[UnitGroup, ...], allocation_unit: int, unit_costs: UnitCosts
    ) -> None:
        self.model = model
        self.unit_costs = unit_costs
        self.groups = groups
        self.unit = allocation_unit
        by_type: dict[str, int] = {}
        for g in groups:
            by_type[g.server.profile_server] = by_type.get(g.server.profile_server, 0) + g.units
        self.type_servers = list(by_type)
        self.counts = list(by_type.values())
        self.units = sum(self.counts)
        self.gpus = self.units * allocation_unit
        unit_specs = [g.server for g in groups for _ in range(g.units)]
        self._unit_spec = unit_specs
        self._unit_server = np.array([i for i, g in enumerate(groups) for _ in range(g.units)])
        self._unit_type = np.array([self.type_servers.index(s.profile_server) for s in unit_specs])
        self._unit_rank = np.zeros(self.units, dtype=np.int64)
        for t in range(len(self.type_servers)):
            where = self._unit_type == t
            self._unit_rank[where] = np.arange(int(where.sum()))
        self.allocation = Allocation.of((g.server, g.units * allocation_unit) for g in groups)
        supported = [set(model.lbs_values(t)) for t in self.type_servers]
        self.lbs_values = sorted(set.intersection(*supported))
        self._buckets: BucketTimes | None = None
        self._leaves: dict[tuple[int, WeightSyncMethod], _Leaves] = {}
        self._tables: dict[tuple[int, WeightSyncMethod], BottleneckTable] = {}
        self._bounds: dict[tuple[int, WeightSyncMethod], FloatArray] = {}

    @property
    def buckets(self) -> BucketTimes:
        if self._buckets is None:
            self._buckets = self.model.bucket_times(self.allocation)
        return self._buckets

    def extra(self, gbs: int, lbs: int) -> int | None:
        """Extra workers per GPU beyond one each, or None when ``gbs`` cannot be split this way."""
        if gbs % lbs or (gbs // lbs) % self.unit:
            return None
        extra = gbs // lbs // self.unit - self.units
        return extra if extra >= 0 else None

    def leaves(self, lbs: int, ws: WeightSyncMethod, size: int) -> _Leaves:
        cached = self._leaves.get((lbs, ws))
        if cached is not None and cached.size >= size:
            return cached
        pairs = [self.unit_costs(t, lbs, ws, self.buckets, size) for t in self.type_servers]
        leaves = _Leaves([c for c, _ in pairs], [v for _, v in pairs])
        self._leaves[(lbs, ws)] = leaves
        return leaves

    def table(self, lbs: int, ws: WeightSyncMethod, size: int) -> BottleneckTable:
        cached = self._tables.get((lbs, ws))
        if cached is not None and cached.size >= size:
            return cached
        table = BottleneckTable(self.leaves(lbs, ws, size).costs, self.counts, size)
        self._tables[(lbs, ws)] = table
        return table

    def lower_bounds(self, lbs: int, ws: WeightSyncMethod, size: int) -> FloatArray:
        """A lower bound on the optimum for every ``E < size``, without any convolution.

        Relaxation: a unit may take any number of extras up to the largest one it
        can do under the threshold (``cost`` made monotone by suffix minima), so
        ``E`` is "reachable" once the ``E``-th smallest step cost is under it.
        Exact when every ``cost`` is non-decreasing.
        """
        cached = self._bounds.get((lbs, ws))
        if cached is not None and cached.size >= size:
            return cached
        costs = self.leaves(lbs, ws, size).costs
        monotone = [np.minimum.accumulate(c[:size][::-1])[::-1] for c in costs]
        floor = max(float(m[0]) for m in monotone)
        steps = np.concatenate([m[1:] for m in monotone])
        weights = np.concatenate([np.full(size - 1, n) for n in self.counts])
        order = np.argsort(steps, kind="stable")
        reached = np.cumsum(weights[order])
        index = np.searchsorted(reached, np.arange(1, size))
        kth = np.append(steps[order], np.inf)[index]
        bounds = np.maximum(floor, np.concatenate(([floor], kth)))
        self._bounds[(lbs, ws)] = bounds
        return bounds

    def plans(self, lbs: int, ws: WeightSyncMethod, gbs: Sequence[int], extras: Sequence[int]) -> list[Plan]:
        """The optimal plans for several GBS values sharing this LBS and method (``extras[i]`` for ``gbs[i]``)."""
        size = max(extras) + 1
        table = self.table(lbs, ws, size)
        leaves = self.leaves(lbs, ws, size)
        rows = len(extras)
        # Unit u (in server order) is unit rank[u] of its type; a type's units take
        # its share largest first, so the first servers carry the most work.
        extra = np.empty((rows, self.units), dtype=np.int64)
        vsw = np.empty_like(extra)
        time_s = np.empty((rows, self.units))
        for t, units in enumerate(table.assignments(extras)):
            where = self._unit_type == t
            e = units[:, self._unit_rank[where]]
            extra[:, where] = e
            vsw[:, where] = leaves.vsw[t][e]
            time_s[:, where] = leaves.costs[t][e]
        ga = (extra + 1) // vsw - 1
        # A new assignment starts wherever the server or the (VSW, GA) changes.
        starts = np.ones((rows, self.units), dtype=bool)
        starts[:, 1:] = (
            (self._unit_server[1:] != self._unit_server[:-1]) | (vsw[:, 1:] != vsw[:, :-1]) | (ga[:, 1:] != ga[:, :-1])
        )
        plans = []
        for i in range(rows):
            first = np.flatnonzero(starts[i])
            count = np.diff(np.append(first, self.units))
            assignments = tuple(
                Assignment(
                    self._unit_spec[u].name,
                    self._unit_spec[u].device_type,
                    int(n) * self.unit,
                    int(vsw[i, u]),
                    int(ga[i, u]),
                    float(time_s[i, u]),
                )
                for u, n in zip(first.tolist(), count.tolist(), strict=True)
            )
            best = table.value(extras[i])
            if not best > 0:
                raise InputError.at(
                    self.model.folders.get("computation"),
                    None,
                    f"the profiles predict {best} s per iteration at LBS {lbs}",
                )
            plans.append(Plan(gbs[i], lbs, ws, best, gbs[i] / best, assignments))
        return plans


class Solver:
    """Plans for one job: ``solve(gbs)`` and ``solve_range(lo, hi)``.

    ``servers`` are the servers to plan for; all their GPUs are used unless
    ``auto``, which also chooses how many units of each server type to use.
    """

    def __init__(
        self,
        model: PerformanceModel,
        servers: Sequence[ServerSpec],
        allocation_unit: int = 1,
        weight_sync: str = "recommend",
        *,
        auto: bool = False,
        max_allocations: int = MAX_AUTO_ALLOCATIONS,
    ) -> None:
        check_allocation_unit(servers, allocation_unit)
        self.model = model
        self.servers = list(servers)
        self.allocation_unit = allocation_unit
        self.auto = auto
        self.methods = weight_sync_methods(model, weight_sync)
        if auto:
            types = server_types(servers, allocation_unit)
            count = count_allocations(types)
            if count > max_allocations:
                raise InputError.at(
                    None,
                    "--servers auto",
                    f"{count} candidate allocations ({len(types)} server types) is more than {max_allocations}; "
                    "use a larger [scaling] allocation_unit or list the servers",
                )
            groups = list(allocations(types))
        else:
            groups = [whole_servers(servers, allocation_unit)]
        costs = UnitCosts(model)
        self._allocations = [_FixedAllocation(model, g, allocation_unit, costs) for g in groups]

    # One GBS ------------------------------------------------------------------

    def solve(self, gbs: int) -> Plan:
        """The fastest plan for ``gbs``; InputError saying why each LBS failed when there is none."""
        check_gbs(gbs)
        candidates = [
            _Candidate(alloc, lbs, ws, extra, extra + 1)
            for alloc in self._allocations
            for lbs in alloc.lbs_values
            if (extra := alloc.extra(gbs, lbs)) is not None
            for ws in self.methods
        ]
        best = self._best(candidates)
        if best is None:
            raise InputError(self.unreachable(gbs))
        return best.allocation.plans(best.lbs, best.weight_sync, [gbs], [best.extra])[0]

    # A range of GBS -------------------------------------------------------------

    def solve_range(self, lo: int, hi: int) -> list[Plan]:
        """The fastest plan for every feasible GBS in ``lo..hi`` (inclusive), in GBS order.

        Each (allocation, LBS, method) table is built once, as large as the
        range needs, and serves every GBS; plans are assembled in batches.
        """
        check_gbs(lo)
        if hi < lo:
            raise InputError.at(None, "--range", f"{lo}:{hi} is empty (HI is below LO)")
        per_gbs: dict[int, list[tuple[_FixedAllocation, int, int]]] = {}
        for alloc in self._allocations:
            for lbs in alloc.lbs_values:
                step = lbs * self.allocation_unit
                first = max(lo, lbs * alloc.gpus)
                first += -first % step
                last = hi - hi % step
                size = last // step - alloc.units + 1  # the largest GBS's extra workers, plus one
                for gbs in range(first, last + 1, step):
                    per_gbs.setdefault(gbs, []).append((alloc, lbs, size))
        winners: dict[tuple[int, int, WeightSyncMethod], list[tuple[int, _Candidate]]] = {}
        for gbs in sorted(per_gbs):
            candidates = [
                _Candidate(alloc, lbs, ws, gbs // (lbs * self.allocation_unit) - alloc.units, size)
                for alloc, lbs, size in per_gbs[gbs]
                for ws in self.methods
            ]
            best = self._best(candidates)
            if best is not None:
                key = (id(best.allocation), best.lbs, best.weight_sync)
                winners.setdefault(key, []).append((gbs, best))
        plans = []
        for batch in winners.values():
            c = batch[0][1]
            plans += c.allocation.plans(c.lbs, c.weight_sync, [g for g, _ in batch], [b.extra for _, b in batch])
        return sorted(plans, key=lambda p: p.gbs)

    def lower_bound(self, gbs: int) -> float:
        """A lower bound on ``solve(gbs).iteration_time_s`` without building any table (inf: unreachable).

        The relaxation of ``_FixedAllocation.lower_bounds``, exact when every
        unit's cost is non-decreasing in its workers; what a planner comparing
        many allocations sorts them by before solving the few that can win.
        """
        check_gbs(gbs)
        best = np.inf
        for alloc in self._allocations:
            for lbs in alloc.lbs_values:
                extra = alloc.extra(gbs, lbs)
                if extra is not None:
                    for ws in self.methods:
                        best = min(best, float(alloc.lower_bounds(lbs, ws, extra + 1)[extra]))
        return best

    def reachable(self, gbs: int) -> bool:
        """Whether some LBS splits ``gbs`` over these GPUs (every GPU at least one worker)."""
        return any(alloc.extra(gbs, lbs) is not None for alloc in self._allocations for lbs in alloc.lbs_values)

    # Any plan --------------------------------------------------------------------

    def predict(self, plan: Plan) -> IterationPrediction:
        """The model's prediction for any plan on these servers (e.g. a measured configuration)."""
        servers = {s.name: s for s in self.servers}
        unknown = sorted({a.server for a in plan.assignments} - set(servers))
        if unknown:
            raise InputError.at(None, "assignments", f"unknown server(s) {', '.join(unknown)}")
        if plan.weight_sync not in WEIGHT_SYNC_METHODS:
            raise InputError.at(None, "weight_sync", f"expected sequential or overlap, got {plan.weight_sync!r}")
        groups = [GroupConfig(servers[a.server], a.gpus, a.vsw, a.ga, a.lbs) for a in plan.assignments]
        return self.model.predict(plan.lbs, plan.weight_sync, groups)  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------

    def _best(self, candidates: list[_Candidate]) -> _Candidate | None:
        """The candidate with the smallest key; with several allocations, pruned by lower bounds."""
        if len(self._allocations) > 1:
            bounds = [c.allocation.lower_bounds(c.lbs, c.weight_sync, c.size)[c.extra] for c in candidates]
            order = sorted(range(len(candidates)), key=lambda i: (bounds[i], candidates[i].allocation.gpus))
        else:
            bounds = [-np.inf] * len(candidates)
            order = list(range(len(candidates)))
        best: _Candidate | None = None
        for i in order:
            c = candidates[i]
            if best is not None and bounds[i] > best.time_s:
                break
            c.time_s = c.allocation.table(c.lbs, c.weight_sync, c.size).value(c.extra)
            if np.isfinite(c.time_s) and (best is None or c.key() < best.key()):
                best = c
        return best

    def unreachable(self, gbs: int) -> list[Problem]:
        """Why no plan reaches ``gbs``: one line per LBS tried."""
        unit = self.allocation_unit
        tried = sorted({b for s in self.servers for b in self.model.lbs_values(s.profile_server)})
        head = Problem(None, "--gbs", f"no plan reaches GBS {gbs}; LBS tried: {', '.join(map(str, tried)) or 'none'}")
        lines = [head]
        alloc = self._allocations[0] if not self.auto else None
        for lbs in tried:
            if gbs % lbs:
                why = f"{gbs} is not a multiple of {lbs}"
            elif (gbs // lbs) % unit:
                why = f"{_workers(gbs // lbs)} cannot be split into allocation units of {unit} GPUs"
            elif alloc is not None and lbs not in alloc.lbs_values:
                missing = [s for s in alloc.type_servers if lbs not in self.model.lbs_values(s)]
                why = "not profiled on " + ", ".join(self._describe(missing))
            elif alloc is not None and gbs // lbs < alloc.gpus:
                why = f"only {_workers(gbs // lbs)} for {alloc.gpus} GPUs (each GPU needs at least one VSW)"
            else:
                why = "no combination of VSW and GA reaches it"
            lines.append(Problem(None, f"LBS {lbs}", why))
        if not tried:
            lines.append(Problem(None, None, "no LBS has both a memory and a computation profile"))
        return lines

    def _describe(self, profile_servers: Iterable[str]) -> list[str]:
        names = []
        for p in profile_servers:
            users = [s.name for s in self.servers if s.profile_server == p]
            device = next(s.device_type for s in self.servers if s.profile_server == p)
            names.append(f"{', '.join(users)} ({device})")
        return names


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def check_gbs(gbs: int) -> None:
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs <= 0:
        raise InputError.at(None, "--gbs", f"the global batch size must be a positive integer, got {gbs!r}")
