"""A lost trainer: recovery in place against a restart from the checkpoint, side by side.

For each workload (digits, the tiny ResNet), a real ``jabas schedule`` and two real
``jabas worker`` agents run on loopback with two one-device CPU servers, A (rank 0)
and B (rank 1), each job twice: with ``[scheduler] recover_in_place = true`` (the
default) and ``false`` (today's restart: every trainer stopped, new ones on the live
servers from the newest checkpoint, written every ``checkpoint_every`` iterations).
After :data:`WARM_S` (the agents' spares are warm, as in a job that has run a while),
the benchmark SIGKILLs B's trainer and notes the time (the fault). The scheduler's
record of the failure (``moves[]``) gives the end of the first iteration completed
after it, and the steps it resumed at::

    time to next iteration = end of the first iteration after - the fault
    steps redone = completed steps trained again (stopped - resumed) + the interrupted one

Target (issue #34): in place at least 5x faster, and only the interrupted step redone.

Run: ``.venv/bin/python benchmarks/recovery.py [--workloads digits resnet_tiny] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from jabascli.elastic.job import TERMINAL
from jabascli.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reallocation import TOKEN, start_job, wait  # the same scheduler and agents, polled the same way

WARM_S = 12.0
CHECKPOINT_EVERY = 50
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"workload": "digits", "options": {"lr": 0.05}, "lbs": 16},
    "resnet_tiny": {"workload": "resnet", "options": {"variant": "tiny", "synthetic_size": 512}, "lbs": 16},
}


def write_config(folder: Path, name: str, in_place: bool) -> Path:
    spec = WORKLOADS[name]
    server = {"device_type": "cpu", "devices": 1, "vsw": 1}
    config = {
        # Never reached: the benchmark stops the job. No validation: a kill landing in an epoch end's would put
        # a validation pass (200 ms on the tiny ResNet, a third of its short epochs) into "the next iteration".
        "job": {"name": name, "epochs": 1_000_000, "validate_every": 1_000_000, **spec},
        "batching": {"metric": "fixed"},
        "cluster": {"available_servers": ["A", "B"], "servers": [{"name": "A", **server}, {"name": "B", **server}]},
        "scheduler": {
            "port": free_port(),
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 30.0,
            "collective_timeout_s": 30.0,
            "checkpoint_every": CHECKPOINT_EVERY,
            "recover_in_place": in_place,
        },
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / f"{name}.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def lose_a_trainer(folder: Path, name: str, in_place: bool) -> dict[str, Any]:
    """One job: B's trainer SIGKILLed once the job is warm; the failure's record and the fault's time."""
    config = write_config(folder, name, in_place)
    url, procs, logs = start_job(folder, config)
    try:
        running = wait(url, lambda s: s["state"] == "running" and len(s["trainers"]) == 2 and s["loss"] is not None)
        time.sleep(WARM_S)
        victim = next(t["pid"] for t in running["trainers"] if t["rank"] == 1)
        fault = time.time()
        os.kill(victim, signal.SIGKILL)
        done = wait(url, lambda s: any(m["failure"] and m["recovered_s"] is not None for m in s["moves"]))
        # In place, or (a survivor that had applied part of an overlap update) the restart that followed.
        record = next(m for m in done["moves"] if m["failure"] and m["recovered_s"] is not None)
        httpx.post(url + "/v1/job/stop", json={"when": "now"}, headers={"Authorization": f"Bearer {TOKEN}"})
        wait(url, lambda s: s["state"] in TERMINAL)
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
    first_done = record["first_iteration_at"] + record["first_iteration_s"]
    return {
        "reason": record["reason"],
        "to_next_s": first_done - fault,
        "detected_s": record["failed_at"] - fault,
        "decided_s": record["launched_at"] - record["failed_at"],
        "rebuilt_s": record["first_iteration_at"] - record["launched_at"],
        "first_iteration_s": record["first_iteration_s"],
        "redone": record["steps_lost"] + 1,
        "taken_back": record.get("updates_taken_back") or 0,
        "stopped": record["stopped_step"],
        "resumed": record["resumed_step"],
    }


TEARDOWN_CHILD = """
import socket, sys, time, torch
tensors = [torch.randn(10_000_000) for _ in range(4)]  # 160 MB, about a small trainer's
connection = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
connection.sendall(b"r")
time.sleep(60)
"""


def teardown_s(repeats: int = 3) -> float:
    """How long after SIGKILL the kernel closes a process's sockets (the median of ``repeats``), for a process that
    imported torch and holds 160 MB of tensors: it unmaps the memory first, so no peer, agent or scheduler can
    see the loss sooner. Part of every "seen after" below, in place or restarted alike."""
    import socket

    times = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for _ in range(repeats):
            child = subprocess.Popen([sys.executable, "-c", TEARDOWN_CHILD, str(port)])
            connection, _ = server.accept()
            with connection:
                connection.recv(1)
                start = time.perf_counter()
                os.kill(child.pid, signal.SIGKILL)
                connection.recv(1)  # b"": the socket closed
                times.append(time.perf_counter() - start)
            child.wait()
    return statistics.median(times)


def _redone(run: dict[str, Any], expected: str) -> str:
    """``1 (240->240)``: steps redone (stopped -> resumed), and whether it restarted or took updates back."""
    notes = [] if run["reason"] == expected else ["restarted"]
    if run["taken_back"]:
        notes.append(f"{run['taken_back']} bucket updates taken back")
    return f"{run['redone']} ({run['stopped']}->{run['resumed']}{''.join(', ' + n for n in notes)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"B's trainer SIGKILLed {WARM_S:g} s into the job; checkpoints every {CHECKPOINT_EVERY} iterations")
    print(f"a SIGKILLed process holding 160 MB of tensors has its sockets closed {teardown_s():.3f} s after the kill")
    print(f"{'workload':<12} {'recovery':<22} {'to next iteration s':>20} {'seen after s':>13} {'steps redone':>13}")
    for name in args.workloads:
        medians: dict[bool, float] = {}
        for in_place in (True, False):
            runs, expected = [], "recovery" if in_place else "restart"
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="jabas-recovery-") as tmp:
                    runs.append(lose_a_trainer(Path(tmp), name, in_place))
            medians[in_place] = statistics.median(r["to_next_s"] for r in runs)
            label = "in place" if in_place else "restart from checkpoint"
            times = ", ".join(f"{r['to_next_s']:.3f}" for r in runs)
            seen = statistics.median(r["detected_s"] for r in runs)
            redone = ", ".join(_redone(r, expected) for r in runs)
            print(f"{name:<12} {label:<22} {medians[in_place]:>9.3f} ({times}) {seen:>8.3f} {redone:>13}")
            parts = {key: statistics.median(r[key] for r in runs) for key in ("decided_s", "rebuilt_s")}
            first = statistics.median(r["first_iteration_s"] for r in runs)
            print(
                f"{'':<12}   from the loss seen: decided after {parts['decided_s']:.3f} s, first iteration began"
                f" {parts['rebuilt_s']:.3f} s after that and took {first:.3f} s"
            )
        print(f"{name:<12} in place is {medians[False] / medians[True]:.1f}x faster to the next iteration")


if __name__ == "__main__":
    main()
