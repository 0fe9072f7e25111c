"""The hybrid planner's search against a brute force on small random instances (blocks <= 6, devices <= 4).

The brute force prices, with the same cost model, every plan of the search's space: every LBS, stage count, device
type and TP degree per stage (any order, not only grouped by type), replica count, block split, checkpoint set and
sharding, and for plain IIDP every split of the micro-batches over the replicas. The search prunes (docs/hybrid-
planner.md: the DP minimises the pipeline's bottleneck stage, not the sum, and checkpoints by the stage's average
block); this test bounds what that loses and checks that it never beats the brute force (same space, same model).
"""

from __future__ import annotations

import itertools
import random

import pytest

from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.hybrid.search import ServerGroup, _place, search
from jabascli.profiles.hybrid import BandwidthFit, BlockInfo, DeviceTimes, HybridProfiles, ModelBlocks, Network

GB = 1e9


def random_profiles(rng: random.Random, n_blocks: int, memory: dict[str, float]) -> HybridProfiles:
    blocks = []
    for i in range(n_blocks):
        p, a = rng.uniform(0.05, 0.4) * GB, rng.uniform(0.05, 0.5) * GB
        blocks.append(
            BlockInfo(name=str(i), params_bytes={1: p, 2: p / 2}, act_bytes={1: a, 2: 0.6 * a}, boundary_bytes=a / 20)
        )
    model = ModelBlocks(model="rand", blocks=blocks, optimizer_bytes_per_param_byte=2.0)
    base = [rng.uniform(0.01, 0.05) for _ in range(n_blocks)]
    devices = {}
    for name, mem in memory.items():
        speed = rng.uniform(1.0, 3.0)
        times = {
            b: {t: [(x * b * speed / t * 1.2, 2 * x * b * speed / t * 1.2, 0.002) for x in base] for t in (1, 2)}
            for b in (1, 2)
        }
        devices[name] = DeviceTimes(device=name, memory_bytes=mem, devices_per_server=2, times=times)
    fit = {d: {1: BandwidthFit(coeffs=[5.0]), 2: BandwidthFit(coeffs=[8.0])} for d in memory}
    slow = {d: {1: BandwidthFit(coeffs=[0.5]), 2: BandwidthFit(coeffs=[1.0])} for d in memory}
    return HybridProfiles(blocks=model, devices=devices, network=Network(intra=fit, inter=slow))


def brute_force(model: CostModel, devices: dict[str, int], gbs: int) -> float:
    n = model.profiles.num_blocks
    best = float("inf")
    for b in (1, 2):
        if gbs % b:
            continue
        n_micro = gbs // b
        for plan in _pipelines(model, devices, b, n_micro, n) + _iidp(devices, b, n_micro, n):
            for ckpt in _subsets(range(n)):
                for sharding in ("none", "full"):
                    p = Plan(b, plan.bounds, plan.replicas, frozenset(ckpt), sharding)  # type: ignore[arg-type]
                    pred = model.predict(p)
                    if pred.fits:
                        best = min(best, pred.iteration_s)
    return best


def _subsets(items: range) -> list[tuple[int, ...]]:
    return [c for k in range(len(items) + 1) for c in itertools.combinations(items, k)]


def _pipelines(model: CostModel, devices: dict[str, int], b: int, n_micro: int, n: int) -> list[Plan]:
    out = []
    for n_stages in range(2, min(4, n) + 1):
        for stages in itertools.product([(d, t) for d in devices for t in (1, 2)], repeat=n_stages):
            use: dict[str, int] = {}
            for d, t in stages:
                use[d] = use.get(d, 0) + t
            for replicas in range(1, 5):
                if any(use[d] * replicas > devices[d] for d in use):
                    continue
                places = _place(model, list(stages), replicas)
                counts = [n_micro // replicas + (r < n_micro % replicas) for r in range(replicas)]
                reps = tuple(Replica(tuple(places[s][r] for s in range(n_stages)), m) for r, m in enumerate(counts))
                for cuts in itertools.combinations(range(1, n), n_stages - 1):
                    out.append(Plan(b, (0, *cuts, n), tuple(r for r in reps if r.microbatches)))
    return out


def _iidp(devices: dict[str, int], b: int, n_micro: int, n: int) -> list[Plan]:
    out = []
    for tps in itertools.product((1, 2), repeat=len(devices)):
        places = [
            Placement(d, t, f"{d}-{k * t // 2}")
            for (d, count), t in zip(devices.items(), tps, strict=True)
            for k in range(count // t)
        ]
        for split in itertools.product(range(n_micro + 1), repeat=len(places)):
            if sum(split) == n_micro:
                reps = tuple(Replica((p,), m) for p, m in zip(places, split, strict=True) if m)
                out.append(Plan(b, (0, n), reps))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_search_matches_brute_force_on_small_instances(seed: int) -> None:
    rng = random.Random(seed)
    n_blocks = rng.randint(3, 6)
    memory = {"fast": rng.uniform(1.5, 4.0) * GB, "slow": rng.uniform(1.5, 4.0) * GB}
    model = CostModel(random_profiles(rng, n_blocks, memory))
    gbs = rng.choice([4, 6, 8])
    devices = {"fast": 2, "slow": 2}
    try:
        found = search(model, [ServerGroup("fast", 1), ServerGroup("slow", 1)], gbs, stage_counts=(1, 2, 3, 4))
    except InputError:
        assert brute_force(model, devices, gbs) == float("inf")
        return
    best = brute_force(model, devices, gbs)
    assert found.prediction.fits
    assert found.prediction.iteration_s >= best * (1 - 1e-9)  # same space, same model: never better
    assert found.prediction.iteration_s <= best * 1.10, (found.plan.describe(), found.prediction.iteration_s, best)


def test_no_plan_fits_names_the_smallest_footprint() -> None:
    rng = random.Random(1)
    model = CostModel(random_profiles(rng, 4, {"fast": 0.2 * GB, "slow": 0.2 * GB}))
    with pytest.raises(
        InputError,
        match=r"no plan fits .*smallest footprint found needs \d+\.\d+ [MG]B on a (fast|slow) .*which has 200\.0 MB",
    ) as err:
        search(model, [ServerGroup("fast", 1), ServerGroup("slow", 1)], 4)
    assert len(err.value.lines()) == 1
    assert brute_force(model, {"fast": 2, "slow": 2}, 4) == float("inf")


def test_device_type_without_profile_is_input_error() -> None:
    model = CostModel(random_profiles(random.Random(0), 3, {"fast": 4 * GB}))
    with pytest.raises(InputError, match=r"servers\.tpu: no hybrid profile of this device type"):
        search(model, [ServerGroup("tpu", 1)], 4)


@pytest.mark.parametrize("seed", range(6))
def test_dealt_plans_give_every_device_a_micro_batch(seed: int) -> None:
    """``deal=True`` (``jabas solve --hybrid``): every replica runs at least one micro-batch per device, and it
    never beats the unrestricted search (a subset of its space). Unrestricted, 10 of these 24 plans break the rule."""
    rng = random.Random(100 + seed)
    model = CostModel(random_profiles(rng, rng.randint(3, 6), {"fast": 3 * GB, "slow": 3 * GB}))
    servers = [ServerGroup("fast", 1), ServerGroup("slow", 1)]
    for gbs in (2, 3, 4, 8):
        try:
            dealt = search(model, servers, gbs, deal=True)
        except InputError:
            continue
        assert all(r.microbatches >= sum(p.tp for p in r.stages) for r in dealt.plan.replicas)
        free = search(model, servers, gbs)
        assert dealt.prediction.iteration_s >= free.prediction.iteration_s * (1 - 1e-9)
