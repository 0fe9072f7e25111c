"""The auto-scaler prices hybrid jobs with the hybrid planner (issue 21): an allocation no plan fits is never chosen,
the chosen allocation's time is the planner's prediction for it, and plain IIDP's time wins when it is faster."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import SolverCostModel
from jabascli.autoscale.hybridcost import HybridCostModel
from jabascli.autoscale.planner import Objective, Planner
from jabascli.autoscale.setup import scaling_from_config
from jabascli.autoscale.trajectory import Segment
from jabascli.config import load_config
from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.job import HybridJob
from jabascli.hybrid.search import ServerGroup, search
from jabascli.perfmodel import PerformanceModel, ServerSpec
from jabascli.profiles import (
    BucketProfile,
    CommProfile,
    CompProfile,
    MemoryProfile,
    ProfileSet,
    ring_allreduce_ideal_ms,
)
from jabascli.profiles.hybrid import DeviceTimes, HybridProfiles
from tests.test_hybrid_solve_cli import GB, job, profiles

PRICE = {"fast": 3.0, "mid": 2.0, "slow": 1.0}
SPEED = {"fast": 1.0, "mid": 2.0, "slow": 3.0}


def hybrid_profiles(memory_gb: float, types: tuple[str, ...] = ("fast", "slow")) -> HybridProfiles:
    """tests/test_hybrid_solve_cli.py's toy model (4 blocks of 4 GB with Adam), on ``types`` (``mid``: 2x fast's
    time) with ``memory_gb`` per device."""
    base = profiles()
    devices: dict[str, DeviceTimes] = {}
    for name in types:
        scale = SPEED[name] / SPEED["slow" if name == "slow" else "fast"]
        src = base.devices["slow" if name == "slow" else "fast"]
        times = {
            b: {t: [(f * scale, g * scale, u) for f, g, u in rows] for t, rows in per_tp.items()}
            for b, per_tp in src.times.items()
        }
        devices[name] = src.model_copy(update={"device": name, "times": times, "memory_bytes": memory_gb * GB})
    network = base.network.model_copy(
        update={
            "intra": {d: base.network.intra["fast"] for d in types},
            "inter": {d: base.network.inter["fast"] for d in types},
        }
    )
    return base.model_copy(update={"devices": devices, "network": network})


def space(types: tuple[str, ...] = ("fast", "slow"), servers: int = 2) -> AllocationSpace:
    """``servers`` servers of 2 devices of each type, in units of one device."""
    specs = [ServerSpec(f"{d}{k}", d, 2, d, 100.0, 50.0, PRICE[d] * 2) for d in types for k in range(servers)]
    return AllocationSpace(specs, 1, {s.name: PRICE[s.device_type] for s in specs})


def cost_model(memory_gb: float, types: tuple[str, ...] = ("fast", "slow"), plain=None) -> HybridCostModel:  # type: ignore[no-untyped-def]
    hybrid = HybridJob(hybrid_profiles(memory_gb, types), [], {}, Path("profiles/hybrid/toy"))
    return HybridCostModel(hybrid, space(types), plain)


def planner_time(memory_gb: float, used: dict[str, tuple[int, int]], gbs: int) -> float:
    """The hybrid planner run by hand (``used``: servers and devices per server of each type): the fastest plan over
    the TP degrees, as ``jabas solve --hybrid``."""
    found = []
    for tp in (1, 2):
        devices = {}
        for name, dev in hybrid_profiles(memory_gb).devices.items():
            times = {b: {tp: rows[tp]} for b, rows in dev.times.items()}
            per_server = used[name][1] if name in used else 2
            devices[name] = dev.model_copy(update={"times": times, "devices_per_server": per_server})
        model = CostModel(hybrid_profiles(memory_gb).model_copy(update={"devices": devices}))
        servers = [ServerGroup(d, n) for d, (n, _) in used.items()]
        try:
            found.append(search(model, servers, gbs, deal=True).prediction.iteration_s)
        except InputError:  # no plan fits at this degree
            continue
    return min(found, default=math.inf)


SEGMENTS = [Segment(16, 100)]


def test_an_allocation_no_plan_fits_is_never_chosen() -> None:
    # 11 GB a device: no single device holds the 16 GB model; two devices of a server can (a pipeline or sharding).
    model = cost_model(11)
    one_gpu: list[Choice] = [(1, 0), (0, 1)]
    for choice in one_gpu:
        assert model.iteration_time(choice, 16) == math.inf
        assert model.priced(choice, 16).by == "none"
    # Cost is the objective: a single slow device would be the cheapest if it were priced.
    decision = Planner(model.space, model, Objective(kind="cost")).plan(SEGMENTS)
    assert decision.choice not in one_gpu
    assert math.isfinite(decision.chosen.time_s)
    # Brute force: the cheapest allocation with a finite time.
    priced = {c: model.iteration_time(c, 16) * 100 / 3600 * model.space.price_per_hour(c) for c in model.space}
    finite = {c: v for c, v in priced.items() if math.isfinite(v)}
    assert decision.chosen.cost == min(finite.values())


def test_the_chosen_allocations_time_is_the_planners_prediction() -> None:
    model = cost_model(11)
    decision = Planner(model.space, model, Objective()).plan(SEGMENTS)
    used = model.space.used(decision.choice)
    per_type = {}
    for name, gpus in used.items():
        per_type.setdefault(name.rstrip("0123456789"), []).append(gpus)
    assert all(len(set(g)) == 1 for g in per_type.values())
    priced = model.priced(decision.choice, 16)
    assert priced.by == "hybrid" and priced.plan is not None
    # The same allocation planned by hand.
    assert priced.time_s == planner_time(11, {d: (len(g), g[0]) for d, g in per_type.items()}, 16)
    assert decision.chosen.time_s == 100 * priced.time_s
    # Every allocation is searched once per GBS, whatever the planner asks.
    searches = model.searches
    Planner(model.space, model, Objective()).plan(SEGMENTS)
    assert model.searches == searches


def test_whole_server_allocations_equal_the_hand_run_planner() -> None:
    model = cost_model(11)
    cases = (
        ((2, 0), {"fast": (1, 2)}),
        ((0, 2), {"slow": (1, 2)}),
        ((2, 2), {"fast": (1, 2), "slow": (1, 2)}),
        ((4, 1), {"fast": (2, 2), "slow": (1, 1)}),
    )
    for choice, used in cases:
        assert model.iteration_time(choice, 16) == planner_time(11, used, 16)


class HalfOfHybrid:
    """A plain cost model that prices every allocation at a fixed time (the data-parallel solver's stand-in)."""

    def __init__(self, time_s: float) -> None:
        self.time_s = time_s

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        return self.time_s


def test_a_model_that_fits_one_device_gets_plain_pricing_when_faster() -> None:
    # 80 GB a device: the model fits one device, and the hybrid planner's fastest plan is plain IIDP itself.
    hybrid = cost_model(80)
    t = hybrid.iteration_time((2, 2), 16)
    assert hybrid.priced((2, 2), 16).plan is not None
    faster = cost_model(80, plain=HalfOfHybrid(t / 2))
    assert faster.iteration_time((2, 2), 16) == t / 2 and faster.priced((2, 2), 16).by == "plain"
    slower = cost_model(80, plain=HalfOfHybrid(t * 2))
    assert slower.iteration_time((2, 2), 16) == t and slower.priced((2, 2), 16).by == "hybrid"
    # No plan fits and plain IIDP cannot either (it has no memory model): plain's time is what is left.
    tight = cost_model(11, plain=HalfOfHybrid(5.0))
    assert tight.priced((1, 0), 16).by == "plain"


def test_a_part_used_server_has_no_hybrid_shape() -> None:
    # 3 fast devices: one whole server and one half of another; the planner takes one device count per type.
    model = cost_model(80)
    assert model.job_of((3, 0)) is None
    assert model.iteration_time((3, 0), 16) == math.inf
    assert model.job_of((4, 0)) is not None


def test_three_types_decide() -> None:
    model = cost_model(11, ("fast", "mid", "slow"))
    decision = Planner(model.space, model, Objective()).plan([Segment(16, 100), Segment(32, 100)])
    assert math.isfinite(decision.chosen.time_s)


def test_setup_picks_the_hybrid_cost_model_for_a_hybrid_job(tmp_path: Path) -> None:
    # A [parallel] job with hybrid profiles only (no plain ones): priced by the hybrid planner, servers as configured.
    config = job(tmp_path, memory_gb=11, extra="[parallel]\ntp = 1\n")
    setup = scaling_from_config(load_config(config))
    model = setup.cost_model
    assert isinstance(model, HybridCostModel) and model.plain is None
    assert [t.device_type for t in setup.space.types] == ["fast", "slow"]
    decision = setup.planner().plan(SEGMENTS)
    assert math.isfinite(decision.chosen.time_s)
    assert model.priced(decision.choice, 16).by == "hybrid"
    # One device of 11 GB holds no plan: never chosen.
    assert all(model.iteration_time(c, 16) == math.inf for c in ((1, 0), (0, 1)))
    assert decision.choice not in ((1, 0), (0, 1))


def test_setup_without_parallel_keeps_the_solver(tmp_path: Path) -> None:
    config = job(tmp_path, memory_gb=11)
    with pytest.raises(InputError):  # no plain profiles: the plain job is told so, as before
        scaling_from_config(load_config(config))


def test_the_lower_bound_never_exceeds_the_time() -> None:
    # Three types, several GBS, budgets that force pipelines or not: the bound the planner prunes by holds.
    for memory in (11, 80):
        model = cost_model(memory, ("fast", "mid", "slow"))
        for gbs in (8, 16, 48):
            for choice in model.space:
                bound = model.lower_bound(choice, gbs)
                assert 0 < bound <= model.iteration_time(choice, gbs) * (1 + 1e-12)


def plain_model(ms: float) -> PerformanceModel:
    """Plain profiles of ``fast`` and ``slow`` (3x the time) at LBS 1 and 2: ``ms`` forward, 2 ``ms`` backward a
    sample on ``fast``, one model per GPU."""
    memory, comp = {}, {}
    for device, speed in (("fast", 1.0), ("slow", 3.0)):
        for lbs in (1, 2):
            memory[(device, lbs)] = MemoryProfile(gpu_type=device, total_memory=2**30, lbs=lbs, max_num_models=1)
            comp[(device, lbs, 1)] = CompProfile(
                model="toy",
                gpu_type=device,
                lbs=lbs,
                num_models=1,
                total_time=0.0,
                data_time=0.0,
                fwd_time=ms * lbs * speed,
                bwd_time=2 * ms * lbs * speed,
                update_time=0.1,
                copy_time=0.0,
                bn_sync_time=0.0,
            )
    ideal = [ring_allreduce_ideal_ms(s * 2**20, 1e9, 2) for s in (1, 4, 16)]
    comm = {k: CommProfile(kind=k, ideal_ms=ideal, measured_ms=ideal) for k in ("intra", "inter")}  # type: ignore[arg-type]
    return PerformanceModel(ProfileSet(memory, comp, BucketProfile(model="toy", bucket_size_distribution=[4.0]), comm))


def test_plain_pricing_from_the_solver_wins_where_faster() -> None:
    # 80 GB devices: the model fits one device. The plain solver (real profiles, the data-parallel solver) prices
    # beside the hybrid planner; each allocation gets the lesser, and each side wins somewhere.
    hybrid_only = cost_model(80)
    for ms, winner in ((0.1, "plain"), (1000.0, "hybrid")):
        plain = SolverCostModel(plain_model(ms), hybrid_only.space)
        both = cost_model(80, plain=plain)
        for choice in hybrid_only.space:
            expected = min(plain.iteration_time(choice, 16), hybrid_only.iteration_time(choice, 16))
            assert both.iteration_time(choice, 16) == expected
            assert both.lower_bound(choice, 16) <= expected
        # One device (no all-reduce; this toy's communication profile makes plain all-reduces dear).
        assert both.priced((1, 0), 16).by == winner
