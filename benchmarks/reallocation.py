"""Reallocation downtime: how long a move stops training, against writing and reading the checkpoint alone.

For each workload (digits, the tiny ResNet), a real ``jabas schedule`` and two
real ``jabas worker`` agents run on loopback with two one-device CPU servers,
A and B. The job starts on A, is moved to A+B and back to A, each time with
``when = now`` (at the next iteration), :data:`ROUNDS` times; both keep A, so both are moves in place
(``engine/handoff.py``): A's trainer carries on, B's is started ahead (A+B) or
leaves (A). With ``--restart``, ``[scheduler] in_place_moves = false``: every
move restarts every trainer (the path of a move that drops rank 0's server).
The scheduler records each move's downtime: the time no iteration ran, from the
end of rank 0's last iteration before it to the start of its first iteration
after it (wall clock, reported by the trainers). The first iteration after is
also shown beside a steady one (the median of the next ones, from
``steps.csv``): its one-off set-up (DDP's bucket rebuild, first kernels) is a
cost of the move too, outside the downtime.

Then, in this process, with each trainer's torch thread count (both servers'
trainers share this machine's cores: ``jabas run --elastic``'s rule), the same
model's checkpoint (the one the move wrote) is written and read back alone
(save + read + restore; medians of 15), and::

    ratio = downtime / (checkpoint write + read)

Target (issue #12): ratio <= 3.

Run: ``.venv/bin/python benchmarks/reallocation.py [--workloads digits resnet_tiny]``.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx
import tomli_w
import torch

from jabascli.config import load_config
from jabascli.elastic.job import TERMINAL
from jabascli.elastic.local import agent_environment
from jabascli.engine.checkpoint import CheckpointState, Progress, read_checkpoint, restore_checkpoint, save_checkpoint
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.layout import checkpoint_folder
from jabascli.net import free_port
from jabascli.workload import load_workload

TOKEN = "benchmark-token-0123456789"
WARM_S = 12.0
ROUNDS = 5
"""Round trips A -> A+B -> A per workload: each move's figures are the median of its five (a 2-core
machine shared by the scheduler, two agents and the trainers stalls one move in five or so)."""
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"workload": "digits", "options": {"lr": 0.05}, "lbs": 16},
    "resnet_tiny": {"workload": "resnet", "options": {"variant": "tiny", "synthetic_size": 512}, "lbs": 16},
}


def write_config(folder: Path, name: str, in_place: bool = True) -> Path:
    spec = WORKLOADS[name]
    server = {"device_type": "cpu", "devices": 1, "vsw": 1}
    config = {
        "job": {"name": name, "epochs": 1_000_000, **spec},  # never reached: the benchmark stops the job
        "batching": {"metric": "fixed"},
        "cluster": {"available_servers": ["A"], "servers": [{"name": "A", **server}, {"name": "B", **server}]},
        "scheduler": {
            "port": free_port(),
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 30.0,
            "in_place_moves": in_place,
        },
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / f"{name}.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/job", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def wait(url: str, until: Any, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    s: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            s = status(url)
            if until(s):
                return s
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting at {url}; the job's last status: {s}")


def start_job(folder: Path, config: Path) -> tuple[str, list[subprocess.Popen[bytes]], list[IO[bytes]]]:
    """The scheduler and the agents of servers A and B (``jabas worker --rank 0|1``), all on this machine;
    (the scheduler's URL, the processes, their logs in ``folder``)."""
    loaded = load_config(config)
    url = f"http://127.0.0.1:{loaded.config.scheduler.port}"
    env = agent_environment(loaded, TOKEN, os.environ)  # both servers on this machine: its cores shared
    command = [sys.executable, "-m", "jabascli"]
    logs = [(folder / f"{p}.log").open("wb") for p in ("scheduler", "worker0", "worker1")]
    procs = [subprocess.Popen([*command, "schedule", "-c", str(config)], env=env, stdout=logs[0], stderr=logs[0])]
    for rank in (0, 1):
        args = [*command, "worker", "-c", str(config), "--rank", str(rank)]
        procs.append(subprocess.Popen(args, env=env, stdout=logs[rank + 1], stderr=logs[rank + 1]))
    return url, procs, logs


def measure_moves(folder: Path, name: str, in_place: bool) -> tuple[list[dict[str, Any]], Path]:
    config = write_config(folder, name, in_place)
    loaded = load_config(config)
    url, procs, logs = start_job(folder, config)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for target in (["A", "B"], ["A"]) * ROUNDS:
            before = len(wait(url, lambda s: s["state"] == "running" and s["loss"] is not None)["moves"])
            time.sleep(WARM_S)  # as between the (rare) moves of a real job: the agents' spares are warm
            httpx.post(url + "/v1/job/move", json={"servers": target, "when": "now"}, headers=headers, timeout=10)
            wait(url, lambda s, n=before: len(s["moves"]) > n and s["moves"][-1]["downtime_s"] is not None)
        moves = status(url)["moves"]
        httpx.post(url + "/v1/job/stop", json={"when": "now"}, headers=headers, timeout=10)
        wait(url, lambda s: s["state"] in TERMINAL)
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
    return moves, checkpoint_folder(loaded)


def checkpoint_alone(name: str, path: Path, threads: int, repeats: int = 15) -> tuple[float, float]:
    """Median seconds to write and to read back (read + restore) this workload's checkpoint.

    With the trainers' torch thread count, once the job's processes are gone.
    """
    torch.set_num_threads(threads)
    time.sleep(1.0)
    spec = WORKLOADS[name]
    workload = load_workload(spec["workload"], spec["options"], None)
    payload = read_checkpoint(path)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    scheduler = workload.lr_scheduler(optimizer)
    restore_checkpoint(payload, path, model=model, optimizer=optimizer, scheduler=scheduler)
    state = CheckpointState(
        model,
        optimizer,
        scheduler,
        Progress(**payload["progress"]),
        workload=workload.name,
        config=payload["config"],
        plan=payload["plan"],
    )
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp))
        for _ in range(repeats):
            start = time.perf_counter()
            _, target = save_checkpoint(store, state)
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            fresh = workload.build_model()
            fresh_optimizer = workload.optimizer(fresh.parameters())
            restore_checkpoint(
                read_checkpoint(target),
                target,
                model=fresh,
                optimizer=fresh_optimizer,
                scheduler=workload.lr_scheduler(fresh_optimizer),
            )
            reads.append(time.perf_counter() - start)
    return statistics.median(writes), statistics.median(reads)


def _iteration_times(steps_csv: Path) -> list[tuple[int, float]]:
    """(step, median iteration seconds) of each row rank 0 logged."""
    with steps_csv.open() as f:
        return [(int(row["step"]), float(row["iteration_s"])) for row in csv.DictReader(f) if row["iteration_s"]]


def _steady_after(steps: list[tuple[int, float]], step: int | None) -> float:
    """The median iteration time over the rows logged after the first one following ``step``."""
    later = [t for s, t in steps if step is not None and s > step][1:6]
    return statistics.median(later) if later else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--keep", action="store_true", help="Keep the run folders (logs) and print where.")
    parser.add_argument("--restart", action="store_true", help="Moves restart every trainer (no moves in place).")
    args = parser.parse_args()
    for name in args.workloads:
        folder = Path(tempfile.mkdtemp(prefix=f"jabas-realloc-{name}-"))
        moves, path = measure_moves(folder, name, in_place=not args.restart)
        loaded = load_config(folder / f"{name}.toml")
        threads = int(agent_environment(loaded, TOKEN, os.environ)["OMP_NUM_THREADS"])  # each trainer's
        write_s, read_s = checkpoint_alone(name, path, threads)
        size_mb = path.stat().st_size / 1e6
        print(f"{name}: checkpoint {size_mb:.1f} MB, write {write_s * 1e3:.1f} ms, read+restore {read_s * 1e3:.1f} ms")
        steps = _iteration_times(folder / "runs" / name / "steps.csv")
        for kind in (["A", "B"], ["A"]):
            same = [m for m in moves if m["to_servers"] == kind]
            downtimes = [m["downtime_s"] for m in same]
            downtime = statistics.median(downtimes)
            first = statistics.median(m["first_iteration_s"] for m in same)
            steady = statistics.median(_steady_after(steps, m["resumed_step"]) for m in same)
            how = "in place" if all(m["in_place"] for m in same) else "restart"
            each = ", ".join(f"{d * 1e3:.1f}" for d in downtimes)
            print(
                f"  move {','.join(same[0]['from_servers'])} -> {','.join(kind)} ({how}): "
                f"downtime {downtime * 1e3:.1f} ms (each: {each}), ratio={downtime / (write_s + read_s):.1f}; "
                f"first iteration after {first * 1e3:.1f} ms, steady {steady * 1e3:.1f} ms"
            )
        if args.keep:
            print(f"  logs in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
