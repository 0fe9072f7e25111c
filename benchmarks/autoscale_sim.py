"""Allocation policies on the seed's reference profiles, and the planner's speed on 64 servers.

(a) `jabas simulate` on the reference data (ResNet-50, node0: 4 x V100, node1:
    4 x P100; the seed's prices, 3.06 $ per GPU-hour x TFLOPS / 14.13), an
    ImageNet-sized epoch (1,281,167 samples), 30 epochs, GBS adjusted every 100
    iterations, three trajectories (growing 256 -> 8192, flat 2048, shrinking
    8192 -> 256), for each objective: completion time, cost, GPU-hours and
    moves of the policies all, best-fixed, jabas and oracle. Targets: jabas
    within 5 % of oracle in completion time on every trajectory, and cheaper
    than all on the growing one.
(b) How long the planner takes for one epoch's decision on the synthetic
    64-server cluster of benchmarks/solver_speed.py (6 device types, 512 GPUs,
    4 x 10^11 allocations; target: under 2 s), best of --repeat.

    .venv/bin/python benchmarks/autoscale_sim.py
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

from jabascli.autoscale.planner import Objective, Planner
from jabascli.autoscale.setup import scaling_from_config
from jabascli.autoscale.simulate import POLICIES, Simulation, simulation_from_config
from jabascli.autoscale.trajectory import epoch_segments
from jabascli.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from solver_speed import REFERENCE, write_synthetic_cluster

TRAJECTORIES = ("grow:256:8192", "flat:2048", "shrink:8192:256")
IMAGENET = 1_281_167


def with_objective(sim: Simulation, objective: Objective) -> Simulation:
    return dataclasses.replace(sim, objective=objective)


def deadline_for(sim: Simulation, slack: float) -> float:
    """``slack`` x the longest epoch of `all`: every epoch can meet it, small allocations only some."""
    return slack * max(e.time_s for e in sim.run("all").epochs)


def simulate(reference: Path, epochs: int, objectives: list[str]) -> None:
    loaded = load_config(reference / "config.json")
    print(f"(a) {epochs} epochs of {IMAGENET} samples on the reference profiles; times in hours")
    for spec in TRAJECTORIES:
        base = simulation_from_config(loaded, spec, epochs=epochs, dataset_size=IMAGENET)
        for name in objectives:
            if name == "cost+deadline":
                objective = Objective("cost", deadline_per_epoch_s=deadline_for(base, 1.5))
                label = f"cost, deadline {objective.deadline_per_epoch_s:.0f} s per epoch (1.5 x all's longest)"
            else:
                objective, label = Objective(name), name  # type: ignore[arg-type]
            sim = with_objective(base, objective)
            start = time.perf_counter()
            results = {p: sim.run(p) for p in POLICIES}
            took = time.perf_counter() - start
            print(f"  {spec:<16} objective {label} ({took:.2f} s to simulate)")
            print(f"    {'policy':<11}{'time h':>9}{'cost $':>9}{'GPU-h':>8}{'moves':>7}  GPUs per epoch")
            for p, r in results.items():
                if r.time_s is None:
                    print(f"    {p:<11}{'cannot run':>9}")
                    continue
                gpus = [e.gpus for e in r.epochs]
                runs = [f"{g}x{sum(1 for _ in grp)}" for g, grp in _groups(gpus)]
                print(
                    f"    {p:<11}{r.time_s / 3600:>9.2f}{r.cost:>9.2f}{r.gpu_hours:>8.1f}{r.moves:>7}  {' '.join(runs)}"
                )
            jabas, oracle, everything = results["jabas"], results["oracle"], results["all"]
            if jabas.time_s and oracle.time_s and everything.cost and jabas.cost:
                print(
                    f"    jabas / oracle time {jabas.time_s / oracle.time_s:.3f} (target <= 1.05); "
                    f"jabas / all cost {jabas.cost / everything.cost:.3f}"
                    + (" (target < 1)" if spec.startswith("grow") else "")
                )


def _groups(values: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1].append(v)
        else:
            out.append((v, [v]))
    return out


def plan_speed(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        setup = scaling_from_config(load_config(write_synthetic_cluster(Path(tmp))))
        space = setup.space
        print(
            f"(b) planning one epoch on {len(space.servers)} servers, {space.gpus(space.everything())} GPUs, "
            f"{len(space.types)} types, {space.count():.2e} allocations"
        )
        cases = {
            "growing 4096 -> 5452": [4096, 4506, 4957, 5452],
            "flat 16384": [16384],
            "small 1024 -> 1239": [1024, 1126, 1239],
        }
        for kind in ("time", "cost"):
            for label, values in cases.items():
                segments = epoch_segments(values, IMAGENET, 100)
                best = math.inf
                for _ in range(repeat):
                    # A fresh cost model each time: nothing cached from the previous run.
                    fresh = scaling_from_config(load_config(write_synthetic_cluster(Path(tmp) / str(time.time_ns()))))
                    planner = Planner(fresh.space, fresh.cost_model, Objective(kind))  # type: ignore[arg-type]
                    start = time.perf_counter()
                    decision = planner.plan(segments)
                    best = min(best, time.perf_counter() - start)
                print(
                    f"    {kind:<5} {label:<22} {best:.2f} s (target 2 s): {decision.chosen.gpus} GPUs, "
                    f"{decision.considered} allocations ranked, {len(decision.candidates)} solved"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run (default 30)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of (b); the best is printed")
    parser.add_argument(
        "--objectives", default="time,cost,cost+deadline", help="comma list of time, cost, cost+deadline"
    )
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="the seed's reference data folder")
    args = parser.parse_args()
    if (args.reference / "config.json").is_file():
        simulate(args.reference, args.epochs, args.objectives.split(","))
    else:
        print(f"(a) skipped: no reference data at {args.reference}")
    plan_speed(args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
