"""The solver is optimal on random small clusters: against brute force over every per-unit assignment."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jabascli.errors import InputError
from jabascli.perfmodel import Allocation, PerformanceModel, ServerSpec
from jabascli.profiles import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    ProfileSet,
    ring_allreduce_ideal_ms,
)
from jabascli.solver import Plan, Solver
from tests.test_solver_reference import check_plan

LBS_VALUES = (2, 4)
ms = st.floats(0.5, 50.0, allow_nan=False).map(lambda x: round(x, 1))


@st.composite
def device_profiles(draw: st.DrawFn, server: str, device: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    memory, comp = {}, {}
    for lbs in LBS_VALUES:
        if lbs != LBS_VALUES[0] and draw(st.booleans()):
            continue  # not every device runs every LBS
        max_vsw = draw(st.integers(1, 3))
        memory[(server, lbs)] = MemoryProfile(gpu_type=device, total_memory=2**30, lbs=lbs, max_num_models=max_vsw)
        measured = draw(st.sets(st.integers(1, max_vsw), min_size=1))  # sparse, as in the seed data
        for v in measured:
            comp[(server, lbs, v)] = CompProfile(
                model="toy",
                gpu_type=device,
                lbs=lbs,
                num_models=v,
                total_time=0.0,
                data_time=draw(ms) / 10,
                fwd_time=draw(ms),
                bwd_time=draw(ms),
                update_time=draw(ms) / 5,
                copy_time=draw(ms) / 10 if v > 1 else 0.0,
                bn_sync_time=draw(st.sampled_from([0.0, 1.0])),
            )
    return memory, comp


@st.composite
def comm_profile(draw: st.DrawFn, kind: str) -> CommProfile:
    bandwidth, world = draw(st.sampled_from([1e9, 4e9])), draw(st.integers(2, 4))
    ideal = [ring_allreduce_ideal_ms(s * 2**20, bandwidth, world) for s in (1, 4, 16)]
    measured = [draw(st.floats(0.0, 2.0)) + draw(st.floats(1.0, 3.0)) * x for x in ideal]
    meta = CommMeta(bandwidth=bandwidth, world_size=world) if draw(st.booleans()) else None
    return CommProfile(kind=kind, ideal_ms=ideal, measured_ms=measured, meta=meta)  # type: ignore[arg-type]


@st.composite
def clusters(draw: st.DrawFn, max_units: int = 3) -> tuple[PerformanceModel, list[ServerSpec], int]:
    memory: dict = {}  # type: ignore[type-arg]
    comp: dict = {}  # type: ignore[type-arg]
    servers: list[ServerSpec] = []
    unit = draw(st.sampled_from([1, 1, 2]))
    for k in range(draw(st.integers(1, 2))):
        mem, cmp_ = draw(device_profiles(f"p{k}", f"dev{k}"))
        memory |= mem
        comp |= cmp_
        for i in range(draw(st.integers(1, 2))):
            devices = unit * draw(st.integers(1, 2))
            servers.append(ServerSpec(f"n{k}{i}", f"dev{k}", devices, f"p{k}", 8e9, draw(st.sampled_from([2e9, 5e9]))))
    while len(servers) > 1 and sum(s.devices for s in servers) // unit > max_units:
        servers.pop()
    buckets = draw(st.lists(st.floats(1.0, 30.0), min_size=1, max_size=3))
    profiles = ProfileSet(
        memory,
        comp,
        BucketProfile(model="toy", bucket_size_distribution=buckets),
        {"intra": draw(comm_profile("intra")), "inter": draw(comm_profile("inter"))},
    )
    return PerformanceModel(profiles), servers, unit


def brute_force(model: PerformanceModel, servers: list[ServerSpec], unit: int, gbs: int, methods: tuple) -> float:  # type: ignore[type-arg]
    """Every (VSW, GA) for every allocation unit, one by one: the plain definition of the optimum."""
    units = [s for s in servers for _ in range(s.devices // unit)]
    buckets = model.bucket_times(Allocation.of((s, s.devices) for s in servers))
    common = set.intersection(*(set(model.lbs_values(s.profile_server)) for s in servers))

    @cache
    def time(profile: str, lbs: int, ws: str, v: int, ga: int) -> float:
        device = model.device(profile, lbs)
        return float(model.iteration_times(device, v, ga, ws, buckets))  # type: ignore[arg-type]

    best = np.inf
    for lbs in common:
        if gbs % lbs or (gbs // lbs) % unit:
            continue
        per_unit = gbs // lbs // unit
        for ws in methods:
            choices = []
            for s in units:
                vmax = model.device(s.profile_server, lbs).max_vsw
                choices.append(
                    [
                        (v * (g + 1), time(s.profile_server, lbs, ws, v, g))
                        for v in range(1, vmax + 1)
                        for g in range(per_unit // v)
                        if v * (g + 1) <= per_unit
                    ]
                )
            for combo in itertools.product(*choices):
                if sum(w for w, _ in combo) == per_unit:
                    best = min(best, max(t for _, t in combo))
    return float(best)


def packed_allocations(servers: list[ServerSpec], unit: int) -> list[list[ServerSpec]]:
    """Every allocation ``auto`` may choose: per group of identical servers, full servers first."""
    key = lambda s: (s.profile_server, s.device_type, s.devices, s.intra_bandwidth, s.inter_bandwidth)  # noqa: E731
    out = []
    for counts in itertools.product(*(range(s.devices // unit + 1) for s in servers)):
        packed = True
        for i, j in itertools.combinations(range(len(servers)), 2):
            if key(servers[i]) == key(servers[j]) and counts[j] and counts[i] < servers[i].devices // unit:
                packed = False  # a later twin is used while an earlier one is not full
        if packed and any(counts):
            out.append(
                [
                    ServerSpec(s.name, s.device_type, k * unit, s.profile_server, s.intra_bandwidth, s.inter_bandwidth)
                    for s, k in zip(servers, counts, strict=True)
                    if k
                ]
            )
    return out


def solve_or_none(solver: Solver, gbs: int) -> Plan | None:
    try:
        return solver.solve(gbs)
    except InputError as exc:
        assert "no plan reaches" in str(exc)
        return None


def draw_gbs(data: st.DataObject, servers: list[ServerSpec], unit: int, least_units: int) -> int:
    """Mostly a GBS some LBS reaches (a few workers beyond one per unit), sometimes any number."""
    if data.draw(st.integers(0, 4)) == 0:
        return data.draw(st.integers(1, 40))
    units = data.draw(st.integers(least_units, sum(s.devices for s in servers) // unit + 4))
    return data.draw(st.sampled_from(LBS_VALUES)) * unit * units


@settings(max_examples=150, deadline=None)
@given(clusters(), st.sampled_from(["recommend", "sequential", "overlap"]), st.data())
def test_fixed_allocation_is_optimal(cluster: tuple, weight_sync: str, data: st.DataObject) -> None:  # type: ignore[type-arg]
    model, servers, unit = cluster
    gbs = draw_gbs(data, servers, unit, sum(s.devices for s in servers) // unit)
    solver = Solver(model, servers, unit, weight_sync)
    expected = brute_force(model, servers, unit, gbs, solver.methods)
    plan = solve_or_none(solver, gbs)
    event("feasible" if plan is not None else "no plan")
    if plan is None:
        assert expected == np.inf
        return
    event(f"{len(plan.assignments)} assignments, {plan.workers} workers")
    check_plan(plan, solver, every_gpu=True)
    assert plan.iteration_time_s == expected


@settings(max_examples=60, deadline=None)
@given(clusters(max_units=4), st.data())
def test_auto_allocation_is_optimal(cluster: tuple, data: st.DataObject) -> None:  # type: ignore[type-arg]
    model, servers, unit = cluster
    gbs = draw_gbs(data, servers, unit, 1)
    solver = Solver(model, servers, unit, "recommend", auto=True)
    expected = min(brute_force(model, a, unit, gbs, solver.methods) for a in packed_allocations(servers, unit))
    plan = solve_or_none(solver, gbs)
    event("feasible" if plan is not None else "no plan")
    if plan is None:
        assert expected == np.inf
        return
    check_plan(plan, solver, every_gpu=False)
    assert plan.iteration_time_s == expected


@settings(max_examples=40, deadline=None)
@given(clusters(), st.integers(1, 16), st.integers(0, 32), st.booleans())
def test_range_equals_one_by_one(cluster: tuple, lo: int, span: int, auto: bool) -> None:  # type: ignore[type-arg]
    model, servers, unit = cluster
    solver = Solver(model, servers, unit, "recommend", auto=auto)
    table = {p.gbs: p for p in solver.solve_range(lo, lo + span)}
    for gbs in range(lo, lo + span + 1):
        plan = solve_or_none(solver, gbs)
        assert (plan is None) == (gbs not in table)
        if plan is not None:
            assert table[gbs] == plan


def test_recommend_follows_the_seed_interference_rule() -> None:
    from jabascli.solver.solve import overlap_interferes

    assert not overlap_interferes([7.81, 30.04, 25.04, 25.25, 9.2])  # ResNet-50: overlap considered
    assert overlap_interferes([40.0, 40.0, 5.0])  # buckets before the last average > 1.5 x 25 MiB
    assert not overlap_interferes([100.0])


def test_allocation_unit_must_divide_every_server() -> None:
    model = PerformanceModel(ProfileSet({}, {}, None))
    with pytest.raises(InputError, match="3 GPUs do not split into units of 2"):
        Solver(model, [ServerSpec("a", "x", 3, "a", 1e9, 1e9)], 2)


def test_profiles_predicting_no_time_are_refused() -> None:
    zero = {"total_time": 0.0, "data_time": 0.0, "fwd_time": 0.0, "bwd_time": 0.0, "update_time": 0.0}
    profiles = ProfileSet(
        {("a", 2): MemoryProfile(gpu_type="x", total_memory=1, lbs=2, max_num_models=1)},
        {("a", 2, 1): CompProfile(model="m", gpu_type="x", lbs=2, num_models=1, copy_time=0.0, **zero)},
        None,
    )
    solver = Solver(PerformanceModel(profiles), [ServerSpec("a", "x", 1, "a", 1e9, 1e9)])
    with pytest.raises(InputError, match=r"the profiles predict 0\.0 s per iteration at LBS 2"):
        solver.solve(4)
