"""MNIST-1D: how long its data takes to make, and what the example config reaches in how long.

First generates the ``mnist1d`` workload's default data (40,000 + 4,000
samples) into a fresh cache folder and reads it back, timing both. Then runs
``jabas run -c examples/mnist1d.toml`` (the quick start's three-rank emulated
cluster, GBS 100) as a user would, with its run and checkpoint folders moved
to a temporary folder, and prints each epoch's validation accuracy and the
iterations and wall time to reach ``--targets``::

    generate 44,000 samples: X s   read the cached .npz: X s
    epoch 1  step 400  val accuracy 0.871  epoch time X s
    ...
    target 0.90: epoch 2, 800 iterations, X s of training
    jabas run: X s wall, final val accuracy X

``--cold`` lets the trainers find no cache (they generate the data
themselves, each one, as on a first run); by default they read the cache in
``~/.cache/jabas`` (written by an earlier run, or by this script's first part).

Run: ``.venv/bin/python benchmarks/mnist1d_example.py [--epochs 5] [--cold]``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from jabascli.workload import load_workload

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mnist1d.toml"


def time_generation() -> None:
    module = load_workload("mnist1d").module
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        module.arrays(44_000, 42, Path(folder))
        made = time.perf_counter() - start
        module.arrays.cache_clear()
        start = time.perf_counter()
        module.arrays(44_000, 42, Path(folder))
        read = time.perf_counter() - start
    print(f"generate 44,000 samples: {made:.1f} s   read the cached .npz: {read:.2f} s")


def run_example(folder: Path, args: argparse.Namespace) -> None:
    config = tomllib.loads(EXAMPLE.read_text())
    config["job"]["epochs"] = args.epochs
    config["storage"] = {"run_dir": str(folder / "runs"), "checkpoint_dir": str(folder / "checkpoints")}
    path = folder / "mnist1d.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    env = dict(os.environ)
    if args.cold:
        env["XDG_CACHE_HOME"] = str(folder / "cache")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jabascli", "run", "-c", str(path)], env=env, capture_output=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"jabas run failed ({done.returncode}):\n{done.stdout.decode()}\n{done.stderr.decode()}")
    with (folder / "runs" / "mnist1d" / "epochs.csv").open() as f:
        rows = list(csv.DictReader(f))
    training = 0.0
    reached: dict[float, str] = {}
    for row in rows:
        training += float(row["time_s"])
        accuracy, epoch = float(row["val_accuracy"]), int(row["epoch"]) + 1
        print(
            f"epoch {epoch}  step {row['step']}  val accuracy {accuracy:.3f}  epoch time {float(row['time_s']):.1f} s"
        )
        for target in args.targets:
            if accuracy >= target and target not in reached:
                reached[target] = f"epoch {epoch}, {row['step']} iterations, {training:.1f} s of training"
    for target in args.targets:
        print(f"target {target:.2f}: {reached.get(target, 'not reached')}")
    print(f"jabas run: {wall:.1f} s wall, final val accuracy {float(rows[-1]['val_accuracy']):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the example run (default: the example's 5)")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.90, 0.94], help="validation accuracies")
    parser.add_argument("--cold", action="store_true", help="the trainers generate the data (no cache)")
    args = parser.parse_args()
    time_generation()
    with tempfile.TemporaryDirectory() as folder:
        run_example(Path(folder), args)


if __name__ == "__main__":
    main()
