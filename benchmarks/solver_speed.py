"""How long `jabas solve --range 256:32768` takes to build its whole table.

(a) the reference cluster (seed data: 2 servers, 4 x V100 + 4 x P100);
(b) a synthetic cluster of 64 servers with 8 GPUs each, 6 device types, whose
    profiles are generated (ResNet-50-like, scaled by each device's TFLOPS and
    memory) and written in the seed layout, with a comm meta file;
(c) not a time: on the reference data, how often a seed-style DP heuristic
    (IIDP's, retold on this model) returns a slower plan than the exact solver.

Each figure is the best of --repeat runs (the machines are shared and noisy).
"setup" reads the profiles and builds the solver; "solve" builds the table.

    .venv/bin/python benchmarks/solver_speed.py
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jabascli.config import load_config
from jabascli.perfmodel import Allocation, PerformanceModel, ServerSpec
from jabascli.profiles import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    ring_allreduce_ideal_ms,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)
from jabascli.solver import Solver, solver_from_config

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "jabas-resnet50-v100-p100"

# name, TFLOPS, memory GiB (after the seed's 9-server example cluster)
DEVICES = [
    ("Tesla V100-PCIE-16GB", 14.13, 16),
    ("Tesla P100-PCIE-16GB", 9.52, 16),
    ("NVIDIA GeForce RTX 3090", 35.58, 24),
    ("TITAN RTX", 16.31, 24),
    ("TITAN V", 14.9, 12),
    ("TITAN Xp", 12.1, 12),
]
LBS_VALUES = (16, 32, 64, 96, 128)
BUCKETS_MIB = [7.81, 30.04, 25.04, 25.25, 9.2]


def write_synthetic_cluster(root: Path, servers: int = 64, gpus: int = 8) -> Path:
    """Profiles and a jabas.toml for ``servers`` servers of 6 device types; returns the config path."""
    profiles = root / "profiles"
    lines = ["[profiles]", f'dir = "{profiles}"', ""]
    for i in range(servers):
        name, tflops, mem_gib = DEVICES[i % len(DEVICES)]
        lines += [
            "[[cluster.servers]]",
            f'name = "node{i}"',
            f'device_type = "{name}"',
            f"devices = {gpus}",
            f"tflops = {tflops}",
            "",
        ]
    for k, (name, tflops, mem_gib) in enumerate(DEVICES):
        server = f"node{k}"  # the first server of each type carries the profiles
        speed = 14.13 / tflops
        for lbs in LBS_VALUES:
            per_vsw_gib = 1.2 + 0.09 * lbs
            max_vsw = min(6, int(mem_gib // per_vsw_gib))
            write_memory_profile(
                profiles / "cluster_mem_profile_data",
                server,
                MemoryProfile(gpu_type=name, total_memory=mem_gib * 2**30, lbs=lbs, max_num_models=max_vsw),
            )
            for v in range(1, max_vsw + 1):
                # One VSW: ResNet-50 on a V100 is ~3 ms per sample; extra VSWs gain up to ~25 %.
                fb = speed * (8.0 + 2.9 * lbs) * v * (1.0 - 0.25 * (1 - 1 / v))
                comp = CompProfile(
                    model="resnet50",
                    gpu_type=name,
                    lbs=lbs,
                    num_models=v,
                    total_time=0.0,
                    data_time=0.12 * lbs * v,
                    fwd_time=fb / 3,
                    bwd_time=2 * fb / 3,
                    update_time=4.5,
                    copy_time=2.1 * (v - 1),
                    bn_sync_time=0.0,
                )
                write_comp_profile(profiles / "cluster_comp_profile_data", server, comp)
    write_bucket_profile(
        profiles / "bucket_profile_data", BucketProfile(model="resnet50", bucket_size_distribution=BUCKETS_MIB)
    )
    for kind, bandwidth, world in (("intra", 15.75e9, gpus), ("inter", 12.5e9, 2 * gpus)):
        sizes = [2**20 * s for s in (1, 5, 10, 25, 50, 100, 150)]
        ideal = [ring_allreduce_ideal_ms(s, bandwidth, world) for s in sizes]
        measured = [0.05 + 1.3 * x for x in ideal]
        meta = CommMeta(bandwidth=bandwidth, world_size=world, backend="nccl")
        write_comm_profile(
            profiles / "comm_profile_data", CommProfile(kind=kind, ideal_ms=ideal, measured_ms=measured, meta=meta)
        )
    config = root / "jabas.toml"
    config.write_text("\n".join(lines))
    return config


def best_of(repeat: int, fn: Callable[[], object]) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(label: str, config: Path, lo: int, hi: int, repeat: int) -> None:
    setup_s, solver = best_of(repeat, lambda: solver_from_config(load_config(config)))
    total_s, plans = best_of(repeat, lambda: solver_from_config(load_config(config)).solve_range(lo, hi))
    assert isinstance(solver, Solver) and isinstance(plans, list)
    gpus = sum(s.devices for s in solver.servers)
    print(
        f"{label}: {len(solver.servers)} servers, {gpus} GPUs, --range {lo}:{hi}: {len(plans)} plans in "
        f"{total_s:.3f} s (setup {setup_s:.3f} s: config, profiles, model; solve {total_s - setup_s:.3f} s), "
        f"best of {repeat}"
    )


def seed_style_dp(model: PerformanceModel, servers: list[ServerSpec], lbs: int, workers: int, ws: str) -> float:
    """The seed's dynamic program (IIDP's DynamicProgrammingSolver), retold on this model.

    Rows are per-unit candidate configurations, ordered as the seed orders them;
    columns are worker totals; a row may replace the configuration of its unit
    in the best set of the row above. Returns the slowest unit's time of the set
    the seed would return, or inf when it finds none. Allocation unit: 1 GPU.
    """
    buckets = model.bucket_times(Allocation.of((s, s.devices) for s in servers))
    units = [s for s in servers for _ in range(s.devices)]
    spare = workers + 1 - (len(units) - 1)  # the seed's pruning bound
    table = []  # (time, workers, unit, vsw, ga)
    for u, s in enumerate(units):
        device = model.device(s.profile_server, lbs)
        for v in range(1, max(min(spare, device.max_vsw), 1) + 1):
            for g in range(min(1000, max(spare // v, 0)) + 1):
                table.append((float(model.iteration_times(device, v, g, ws, buckets)), v * (g + 1), u, v, g))
    table.sort(key=lambda row: row[1])
    table = sorted(table[: len(units)]) + sorted(table[len(units) :], key=lambda row: row[0])
    singles = [row for row in table if row[1] == 1]
    firsts: dict[tuple[int, int], tuple] = {}  # type: ignore[type-arg]
    for row in table:
        if row[1] != 1:
            firsts.setdefault((row[1], row[2]), row)
    table = singles + list(firsts.values())

    columns = workers + 1
    empty = (0.0, 0.0, 0, ())  # throughput, time, workers, rows in the set
    dp = [[empty] * columns for _ in table]
    for j in range(1, columns):
        if table[0][1] <= j:
            dp[0][j] = (lbs * table[0][1] / table[0][0], table[0][0], table[0][1], (table[0],))
    reached = 1
    for i in range(1, len(table)):
        row = table[i]
        if row[1] > columns:
            continue
        if i == 1:
            dp[1][reached] = dp[0][reached]
            reached += 1
        for j in range(1, reached):
            dp[i][j] = dp[i - 1][j]
        for j in range(reached, columns):
            above = dp[i - 1][j]
            chosen = (*(r for r in above[3] if r[2] != row[2]), row)  # the row replaces its unit's entry
            time = max(row[0], above[1])
            total = sum(r[1] for r in chosen)
            throughput = lbs * total / time
            if (throughput > above[0] and total < j) or total == j:
                dp[i][j] = (throughput, time, total, chosen)
                if total == j:
                    reached = total + 1
                    for k in range(j + 1, columns):
                        dp[i][k] = dp[i][j]
                    break
            else:
                dp[i][j] = above
    for i in range(len(table) - 1, -1, -1):
        _, time, total, chosen = dp[i][columns - 1]
        if total == workers and len(chosen) == len(units):
            return time
    return math.inf


def compare_with_seed_dp(config: Path, lo: int, hi: int, step: int) -> None:
    """For how many GBS does the seed-style DP return a slower plan than the exact solver (same model)?"""
    solver = solver_from_config(load_config(config), weight_sync="overlap")  # the seed recommends overlap here
    worse, none, total = 0, 0, 0
    for gbs in range(lo, hi + 1, step):
        optimum = solver.solve(gbs).iteration_time_s
        lbs_values = set.intersection(*(set(solver.model.lbs_values(s.profile_server)) for s in solver.servers))
        seed = math.inf  # the seed keeps the LBS with the best throughput, i.e. the fastest at this GBS
        for lbs in sorted(lbs_values):
            if gbs % lbs == 0 and gbs // lbs >= sum(s.devices for s in solver.servers):
                seed = min(seed, seed_style_dp(solver.model, solver.servers, lbs, gbs // lbs, "overlap"))
        total += 1
        none += seed == math.inf
        worse += math.inf > seed > optimum * (1 + 1e-12)
        assert seed >= optimum * (1 - 1e-12), (gbs, seed, optimum)  # nothing beats the optimum
    print(
        f"(c) seed-style DP vs exact, reference data, GBS {lo}..{hi} step {step}, weight sync overlap: "
        f"slower at {worse} of {total} GBS, no plan at {none}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is printed")
    parser.add_argument("--range", default="256:32768", help="LO:HI of the table (default 256:32768)")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="the seed's reference data folder")
    parser.add_argument("--no-seed-dp", action="store_true", help="skip (c), the comparison with the seed's DP")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.range.split(":"))
    reference = args.reference / "config.json"
    if reference.is_file():
        measure("(a) reference", reference, lo, hi, args.repeat)
    else:
        print(f"(a) reference: skipped, no data at {args.reference}")
    with tempfile.TemporaryDirectory() as tmp:
        measure("(b) synthetic", write_synthetic_cluster(Path(tmp)), lo, hi, args.repeat)
    if reference.is_file() and not args.no_seed_dp:
        compare_with_seed_dp(reference, 256, 8192, 32)
    return 0


if __name__ == "__main__":
    sys.exit(main())
