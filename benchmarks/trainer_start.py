"""Trainer start: `jabas run` with its trainers forked from a fork server against fresh processes.

Each round runs the same short job twice, in turn: once as `jabas run` starts trainers by default (forked
from a process that imported torch once, src/jabascli/forkserver.py) and once with ``JABAS_FORK_SERVER=0``
(every rank a fresh interpreter importing torch itself). It prints, per way, the median wall time of the
whole command and the CPU time it and its children used, and their ratios::

    ranks=R  fresh: W s wall, C CPU-s   forked: W s wall, C CPU-s   ratio wall=X cpu=Y

The job is digits for ``--steps`` iterations over ``--ranks`` ranks (emulated devices on the CPU), so what is
timed is mostly the start: imports, rendezvous, the model, one checkpoint at the end.

Run: ``.venv/bin/python benchmarks/trainer_start.py [--ranks 4 --rounds 3 --steps 2]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
[job]
name = "start"
workload = "digits"
epochs = 1
lbs = 8

[batching]
metric = "fixed"
initial_gbs = {gbs}

[[cluster.servers]]
name = "box"
device_type = "cpu"
devices = {ranks}
vsw = 1

[storage]
run_dir = "runs"
checkpoint_dir = "checkpoints"
"""


def timed_run(folder: Path, steps: int, fresh: bool) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the command and every child it waited for) of one `jabas run`."""
    env = {**os.environ, "JABAS_FORK_SERVER": "0" if fresh else "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "jabascli", "run", "-c", "job.toml", "--max-steps", str(steps), "--fresh"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"jabas run failed:\n{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "job.toml").write_text(JOB.format(ranks=args.ranks, gbs=8 * args.ranks))
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for fresh in (True, False):
                times[fresh].append(timed_run(folder, args.steps, fresh))
    wall = {fresh: statistics.median(w for w, _ in runs) for fresh, runs in times.items()}
    cpu = {fresh: statistics.median(c for _, c in runs) for fresh, runs in times.items()}
    print(
        f"ranks={args.ranks}  fresh: {wall[True]:.1f} s wall, {cpu[True]:.1f} CPU-s   "
        f"forked: {wall[False]:.1f} s wall, {cpu[False]:.1f} CPU-s   "
        f"ratio wall={wall[False] / wall[True]:.2f} cpu={cpu[False] / cpu[True]:.2f}"
    )


if __name__ == "__main__":
    main()
