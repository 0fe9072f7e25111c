"""Adaptive batching against fixed GBS: digits and MNIST-1D on the quick start's emulated cluster.

The quick start's three ranks (two "fast" CPU devices with 2 VSWs each, one
emulated device twice as slow with 1 VSW; a GBS of ``LBS x 5`` workers) train
each workload several ways, all from the same seeds:

* ``fixed-small``: the quick start's GBS, ``LBS x 5``;
* ``fixed-large``: four times that (``GA = 3`` everywhere), the LR scaled by the
  same rule as the adaptive ways use at that GBS;
* ``similarity``, ``noise_scale``, ``goodput``: adaptive, starting at the
  small GBS, bounded by ``[small, large]``, LR scaled by ``--lr-scaling``.
  ``goodput`` needs profiles: the script first profiles the cluster with the
  real profilers (memory, computation, bucket, inter-node all-reduce), at the
  workload's LBS; with profiles present every adaptive way replans with the
  solver.

Per way it prints: wall time (from the trainers' start event) and iterations
to the target validation accuracy (0.95 for digits; 0.94 for MNIST-1D, the
paper's CNN reaching about 94 %), the final accuracy, the number of GBS
changes, the GBS at start and end, and the measurement overhead: the time rank
0 spent in the adaptive hook (keeping the first half, its all-reduce, the
inner products, deciding, broadcasting) as a share of the training wall time.

The machine is shared: wall times vary by tens of percent between runs; this
prints figures, it asserts nothing.

    .venv/bin/python benchmarks/adaptive_batching.py [--workloads digits,mnist1d] [--ways ...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import tomli_w

from jabascli.adaptive.lr_scaling import lr_factor
from jabascli.config import load_config
from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions
from model_accuracy import jabas, profile_comm_across_nodes

WORKLOADS: dict[str, dict[str, Any]] = {
    # the quick start: 1,437 training samples, 17 iterations per epoch at GBS 80
    "digits": {"options": {"lr": 0.05}, "lbs": 16, "epochs": 30, "target": 0.95, "interval": 10},
    # 40,000 samples, 400 iterations per epoch at GBS 100; the paper's CNN reaches about 94 %
    "mnist1d": {"options": {"lr": 0.01}, "lbs": 20, "epochs": 4, "target": 0.94, "interval": 100},
}
WAYS = ("fixed-small", "fixed-large", "similarity", "noise_scale", "goodput")
LARGE = 4  # fixed-large runs GA = 3: four times the workers


def config_for(workload: str, way: str, folder: Path, args: argparse.Namespace, profiles: Path | None) -> Path:
    spec = WORKLOADS[workload]
    small = spec["lbs"] * 5
    ga = LARGE - 1 if way == "fixed-large" else 0
    options = dict(spec["options"])
    if way == "fixed-large":
        options["lr"] = options["lr"] * lr_factor(args.lr_scaling, small * LARGE, small)
    job = {"name": f"{workload}-{way}", "workload": workload, "epochs": spec["epochs"], "lbs": spec["lbs"]}
    job.update(options=options, seed=0)
    batching: dict[str, Any] = {"metric": "fixed"}
    if not way.startswith("fixed"):
        batching = {"metric": way, "gbs_min": small, "gbs_max": small * LARGE, "initial_gbs": small}
        batching.update(adjust_interval=args.interval or spec["interval"], adjust_rate=0.25)
        batching.update(similarity_target=args.similarity_target, lr_scaling=args.lr_scaling)
    servers = [
        {"name": "fast", "device_type": "cpu", "devices": 2, "vsw": 2, "ga": ga},
        {"name": "slow", "device_type": "cpu", "devices": 1, "vsw": 1, "ga": ga},
    ]
    servers[1]["emulate"] = {"slowdown": 2.0, "memory_bytes": 2_000_000_000}
    config: dict[str, Any] = {"job": job, "batching": batching, "cluster": {"servers": servers}}
    config["storage"] = {"run_dir": str(folder / "runs"), "checkpoint_dir": str(folder / "checkpoints")}
    if profiles is not None:
        config["profiles"] = {"dir": str(profiles)}
    path = folder / f"{workload}-{way}.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def profile(config: Path, lbs: int, folder: Path) -> None:
    """Memory, computation and bucket profiles of both servers at ``lbs``, and the inter-node all-reduce profile."""
    log = folder / "profile.log"
    for server in ("fast", "slow"):
        jabas("profile", "mem", "-c", str(config), "--threads", "1", "--server", server, "--lbs", str(lbs),
              "--search", "static", "--max-vsw", "8", log=log)  # fmt: skip
        jabas("profile", "comp", "-c", str(config), "--threads", "1", "--server", server, "--iters", "20", log=log)
    jabas("profile", "bucket", "-c", str(config), log=log)
    profile_comm_across_nodes(config, folder, sizes="0.03125:2")


def train(config: Path, target: float) -> dict[str, Any]:
    events: list[tuple[float, dict[str, Any]]] = []
    run_local(load_config(config), TrainOptions(), lambda e: events.append((time.perf_counter(), e)))
    t0 = next(t for t, e in events if e["event"] == "start")
    start = next(e for _, e in events if e["event"] == "start")
    epochs = [(t, e) for t, e in events if e["event"] == "epoch"]
    done_t = next(t for t, e in events if e["event"] == "done")
    reached = next(((t, e) for t, e in epochs if (e["val_accuracy"] or 0) >= target), None)
    adjustments = [e for _, e in events if e["event"] == "adjustment"]
    overhead = adjustments[-1]["overhead_s"] if adjustments else 0.0
    gbs_end = adjustments[-1]["new_gbs"] if adjustments else start["gbs"]
    return {
        "to_target_s": None if reached is None else reached[0] - t0,
        "to_target_steps": None if reached is None else reached[1]["step"],
        "final_accuracy": epochs[-1][1]["val_accuracy"],
        "changes": sum(a["changed"] for a in adjustments),
        "gbs": f"{start['gbs']} -> {gbs_end}",
        "overhead": overhead / (done_t - t0),
        "wall_s": done_t - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="digits,mnist1d")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--lr-scaling", default="sqrt", help="LR rule of the adaptive ways and fixed-large")
    parser.add_argument("--similarity-target", type=float, default=0.1)
    parser.add_argument("--interval", type=int, help="adjust_interval (default: 10 for digits, 100 for MNIST-1D)")
    parser.add_argument("--workdir", type=Path, help="keep configs, profiles and runs here")
    args = parser.parse_args()
    ways = args.ways.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        for workload in args.workloads.split(","):
            spec = WORKLOADS[workload]
            folder = root / workload
            folder.mkdir(parents=True, exist_ok=True)
            profiles = None
            if "goodput" in ways:
                profiles = folder / "profiles"
                started = time.perf_counter()
                profile(config_for(workload, "fixed-small", folder, args, profiles), spec["lbs"], folder)
                print(f"{workload}: profiled in {time.perf_counter() - started:.0f} s", flush=True)
            print(f"\n{workload}: target validation accuracy {spec['target']}, LR scaling {args.lr_scaling}")
            header = f"{'way':<12} {'to target':>10} {'iters':>6} {'final acc':>9} {'changes':>7} {'GBS':>12} "
            print(header + f"{'overhead':>8} {'wall':>7}", flush=True)
            for way in ways:
                r = train(config_for(workload, way, folder, args, profiles), spec["target"])
                to = "-" if r["to_target_s"] is None else f"{r['to_target_s']:.1f} s"
                steps = "-" if r["to_target_steps"] is None else str(r["to_target_steps"])
                print(
                    f"{way:<12} {to:>10} {steps:>6} {r['final_accuracy']:>9.4f} {r['changes']:>7} {r['gbs']:>12} "
                    f"{r['overhead'] * 100:>7.2f}% {r['wall_s']:>6.1f}s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
