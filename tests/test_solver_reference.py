"""On the seed's V100/P100 data, every plan is valid and as fast as exhaustive search finds."""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.errors import InputError
from jabascli.perfmodel import Allocation, GroupConfig, PerformanceModel, ServerSpec
from jabascli.solver import Plan, Solver, solver_from_config


def check_plan(plan: Plan, solver: Solver, *, every_gpu: bool) -> None:
    """Exact GBS, memory limits, one VSW per used GPU, and the model agrees with the plan's times."""
    model, servers = solver.model, {s.name: s for s in solver.servers}
    assert plan.lbs * sum(a.gpus * a.vsw * (a.ga + 1) for a in plan.assignments) == plan.gbs
    used: dict[str, int] = {}
    for a in plan.assignments:
        server = servers[a.server]
        assert a.device_type == server.device_type
        assert 1 <= a.vsw <= model.profiles.max_vsw(server.profile_server, plan.lbs)
        assert a.ga >= 0 and a.gpus >= 1 and a.gpus % solver.allocation_unit == 0
        used[a.server] = used.get(a.server, 0) + a.gpus
    assert all(used[name] <= servers[name].devices for name in used)
    if every_gpu:
        assert used == {name: s.devices for name, s in servers.items()}
    groups = [GroupConfig(servers[a.server], a.gpus, a.vsw, a.ga) for a in plan.assignments]
    predicted = model.predict(plan.lbs, plan.weight_sync, groups)  # type: ignore[arg-type]
    assert solver.predict(plan) == predicted
    assert predicted.time_s == plan.iteration_time_s
    assert [g.time_s for g in predicted.groups] == [a.iteration_time_s for a in plan.assignments]
    assert plan.throughput == plan.gbs / plan.iteration_time_s


def exhaustive_optimum(model: PerformanceModel, servers: list[ServerSpec], gbs: int, methods: tuple[str, ...]) -> float:
    """The issue's bottleneck search, written independently of the solver.

    Every GPU picks any (VSW, GA) on its own. For each LBS and method, the
    candidate thresholds are every time a GPU can take, in increasing order; a
    threshold is feasible when the exact worker total is a subset sum of
    per-GPU choices under it (plain boolean convolutions, GPU by GPU). The
    first feasible threshold is the optimum; feasibility only grows with the
    threshold, so it is found by bisection.
    """
    gpus = sum(s.devices for s in servers)
    buckets = model.bucket_times(Allocation.of((s, s.devices) for s in servers))
    lbs_values = set.intersection(*(set(model.lbs_values(s.profile_server)) for s in servers))
    best = np.inf
    for lbs in sorted(lbs_values):
        workers = gbs // lbs
        if gbs % lbs or workers < gpus:
            continue
        alone = workers - (gpus - 1)  # the most one GPU can take: the others need one worker each
        for ws in methods:
            options = []  # per server: (workers, time) of every (VSW, GA) one of its GPUs can run
            for s in servers:
                device = model.device(s.profile_server, lbs)
                pairs = []
                for v in range(1, device.max_vsw + 1):
                    ga = np.arange(alone // v)
                    times = model.iteration_times(device, v, ga, ws, buckets)  # type: ignore[arg-type]
                    pairs += [(v * (g + 1), float(t)) for g, t in zip(ga.tolist(), times.tolist(), strict=True)]
                options.append(pairs)
            thresholds = sorted({t for pairs in options for _, t in pairs})
            first = bisect.bisect_left(
                range(len(thresholds)),
                True,
                key=lambda i, o=options, w=workers: reachable(w, servers, o, thresholds[i]),
            )
            if first < len(thresholds):
                best = min(best, thresholds[first])
    return float(best)


def reachable(
    workers: int, servers: list[ServerSpec], options: list[list[tuple[int, float]]], threshold: float
) -> bool:
    """Is ``workers`` a sum of one choice per GPU, each taking at most ``threshold``?"""
    reach = np.zeros(workers + 1, dtype=np.int64)
    reach[0] = 1
    for s, pairs in zip(servers, options, strict=True):
        allowed = np.zeros(workers + 1, dtype=np.int64)
        allowed[[w for w, t in pairs if t <= threshold]] = 1
        for _ in range(s.devices):
            reach = (np.convolve(reach, allowed)[: workers + 1] > 0).astype(np.int64)
    return bool(reach[workers])


@pytest.fixture(scope="module")
def reference_config() -> Path:
    from tests.conftest import REFERENCE_RUN

    if not REFERENCE_RUN.is_dir():
        pytest.skip(f"reference data not found at {REFERENCE_RUN}")
    return REFERENCE_RUN / "config.json"


def test_every_gbs_256_to_8192_is_optimal(reference_config: Path) -> None:
    solver = solver_from_config(load_config(reference_config))
    assert solver.methods == ("sequential", "overlap")  # recommend compares both on this model
    table = {p.gbs: p for p in solver.solve_range(256, 8192)}
    for gbs in range(256, 8193, 32):
        plan = solver.solve(gbs)
        check_plan(plan, solver, every_gpu=True)
        assert plan.iteration_time_s == exhaustive_optimum(solver.model, solver.servers, gbs, solver.methods), gbs
        assert table[gbs].iteration_time_s == plan.iteration_time_s
    assert sorted(table) == list(range(256, 8193, 32))
    # What `jabas solve --range ... --json` prints is exactly these plans.
    result = CliRunner().invoke(
        app, ["solve", "-c", str(reference_config), "--range", "256:8192", "--servers", "all", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plans"] == [table[g].to_dict() for g in sorted(table)]


def test_gbs_128_256_512(reference_config: Path) -> None:
    loaded = load_config(reference_config)
    auto = solver_from_config(loaded, "auto")
    plan = auto.solve(128)
    # The seed's published answer for this data.
    assert (plan.lbs, plan.weight_sync, plan.seed_form()) == (32, "overlap", "node0:4GPU,VSW:1,GA:0")
    check_plan(plan, auto, every_gpu=False)
    every = solver_from_config(loaded)
    with pytest.raises(InputError) as info:
        every.solve(128)  # 8 GPUs need at least 8 workers of 32 samples
    text = "\n".join(info.value.lines())
    assert "LBS tried: 32, 64, 96, 128, 160" in text and "only 4 workers for 8 GPUs" in text
    for gbs in (256, 512):
        plan = every.solve(gbs)
        check_plan(plan, every, every_gpu=True)
        assert auto.solve(gbs).iteration_time_s <= plan.iteration_time_s


def test_auto_is_the_best_allocation(reference_config: Path) -> None:
    """--servers auto equals the best over every count of V100s and P100s, each solved exhaustively."""
    loaded = load_config(reference_config)
    auto = solver_from_config(loaded, "auto")
    v100, p100 = auto.servers
    for gbs in (128, 224, 256, 384, 640, 1024):
        best = np.inf
        for k0 in range(5):
            for k1 in range(5):
                servers = [
                    ServerSpec(s.name, s.device_type, k, s.profile_server, s.intra_bandwidth, s.inter_bandwidth)
                    for s, k in ((v100, k0), (p100, k1))
                    if k
                ]
                if servers:
                    best = min(best, exhaustive_optimum(auto.model, servers, gbs, auto.methods))
        plan = auto.solve(gbs)
        check_plan(plan, auto, every_gpu=False)
        assert plan.iteration_time_s == best, gbs
