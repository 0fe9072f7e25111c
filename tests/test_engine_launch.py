"""`jabas run`: progress and results, metrics on disk, a crashed trainer, Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jabascli.engine.checkpoint import read_checkpoint
from tests.conftest import WITH_SIGINT, run_jabas
from tests.engine_support import write_job


def live_trainers(config: Path) -> list[int]:
    """Processes still running `jabas train` on this config: started fresh (the command line says so), or
    forked by a fork server (named jabas-train, writing into a log under the config's folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
                forked = (proc / "comm").read_text().strip() == "jabas-train"
                output = os.readlink(proc / "fd" / "1") if forked else ""
            except OSError:
                continue
            if (b"train" in cmdline and str(config).encode() in cmdline) or output.startswith(f"{config.parent}/"):
                pids.append(int(proc.name))
    return pids


def test_run_trains_every_rank_and_reports_epochs_and_metrics(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(2, 0), (1, 1)], options={"samples": 100}, epochs=2)
    result = run_jabas("run", "-c", str(config), "--json")
    assert result.returncode == 0, result.stderr
    epochs = json.loads(result.stdout)
    assert [e["epoch"] for e in epochs] == [0, 1] and [e["step"] for e in epochs] == [6, 12]  # GBS 16
    assert all(0 <= e["val_accuracy"] <= 1 and e["val_loss"] > 0 and e["train_loss"] > 0 for e in epochs)

    run = tmp_path / "runs" / "job"
    with (run / "epochs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [6, 12] and float(rows[1]["val_accuracy"]) == epochs[1]["val_accuracy"]
    with (run / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    assert steps and steps == sorted(steps) and steps[-1] == 12
    assert all(float(r["iteration_s"]) > 0 for r in rows)  # the median duration of the row's iterations
    with (run / "changes.csv").open() as f:  # the workload's StepLR(7, 0.5): iteration 8 is the first at half
        changes = [(int(r["step"]), int(r["gbs"]), float(r["lr"])) for r in csv.DictReader(f)]
    assert changes == [(1, 16, 0.1), (8, 16, 0.05)]
    kinds = {json.loads(line)["kind"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert kinds == {"step", "epoch"}
    assert list((run / "tensorboard" / "attempt-1").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "job" / "checkpoint-12.pt").is_file()

    table = run_jabas("run", "-c", str(config), "--fresh")
    assert table.returncode == 0, table.stderr
    assert "GBS 16 = LBS 4 x 4 workers" in table.stdout and "val accuracy" in table.stdout
    assert table.stdout.strip().splitlines()[-1].startswith("validation accuracy: ")


def test_a_crashed_trainer_stops_the_others_and_its_error_is_reported(tmp_path: Path) -> None:
    options = {"samples": 400, "crash_rank": 1, "crash_after": 6}
    config = write_job(tmp_path, [(1, 0), (1, 1), (1, 0)], options=options, epochs=50)
    result = run_jabas("run", "-c", str(config))
    assert result.returncode == 1, result.stderr
    assert "error: trainer rank 1 failed: RuntimeError: boom on rank 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert live_trainers(config) == []
    assert "boom on rank 1" in (tmp_path / "runs" / "job" / "logs" / "rank1.log").read_text()


def test_ctrl_c_stops_every_trainer_and_leaves_no_partial_files(tmp_path: Path) -> None:
    servers = [
        {"name": "a", "device_type": "cpu", "devices": 1, "vsw": 1, "ga": 0},
        {"name": "b", "device_type": "cpu", "devices": 1, "emulate": {"slowdown": 20.0, "memory_bytes": 10**9}},
    ]
    config = write_job(tmp_path, [(1, 0), (1, 0)], options={"samples": 400}, epochs=100, servers=servers)
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_SIGINT, "run", "-c", str(config), "--checkpoint-every", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    manifest = tmp_path / "checkpoints" / "job" / "checkpoints.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert manifest.exists(), proc.communicate()
    assert len(live_trainers(config)) == 2
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert f"interrupted: `jabas run -c {config}` resumes from the last checkpoint" in stderr
    assert "Traceback" not in stderr
    assert live_trainers(config) == []
    names = [p.name for p in manifest.parent.iterdir()]
    assert [n for n in names if not n.startswith("checkpoint-") and n != manifest.name] == []  # no partial file
    read_checkpoint(manifest.parent)  # the newest checkpoint is whole
    for line in (tmp_path / "runs" / "job" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # whole lines only
