"""Each rank's busy time rides along in the last bucket's all-reduce and reaches ``busy.csv`` (engine/busy.py).

Two real gloo trainers, the second an emulated device 6x slower (it sleeps 5x each compute step's CPU time,
engine/vsw.py): both end every iteration together, so the iteration time says nothing of the fast rank, and
only the busy times tell the two apart.
"""

from __future__ import annotations

import csv
from pathlib import Path

from jabascli.engine.metrics import median_busy_s, median_iteration_s
from tests.conftest import run_jabas
from tests.engine_support import write_job


def test_every_rank_reports_its_busy_time_and_the_slow_rank_is_busy_longer(tmp_path: Path) -> None:
    servers = [
        {"name": "fast", "device_type": "cpu", "devices": 1, "vsw": 1, "ga": 1},
        {
            "name": "slow",
            "device_type": "cpu-x6",
            "devices": 1,
            "vsw": 1,
            "ga": 1,
            "emulate": {"slowdown": 6.0, "memory_bytes": 10**9},
        },
    ]
    config = write_job(tmp_path, [(1, 1), (1, 1)], options={"samples": 400}, epochs=1, servers=servers)
    result = run_jabas("run", "-c", str(config), "--max-steps", "30")
    assert result.returncode == 0, result.stderr + result.stdout

    run = tmp_path / "runs" / "job"
    with (run / "busy.csv").open() as f:
        rows = list(csv.DictReader(f))
    with (run / "steps.csv").open() as f:
        logged = {int(r["step"]) for r in csv.DictReader(f)}
    # A row per rank for each row of steps.csv, over the same steps.
    assert {(int(r["step"]), int(r["rank"])) for r in rows} == {(s, r) for s in logged for r in (0, 1)}
    busy = median_busy_s(run / "busy.csv")
    iteration = median_iteration_s(run / "steps.csv")
    assert iteration is not None and set(busy) == {0, 1}
    # The slow rank computes six times as long (its sleep follows its CPU time, so a loaded host narrows it).
    assert busy[1] > 1.5 * busy[0], busy
    # A busy time is a part of its rank's iteration: the slow rank's takes up most of it, the fast rank's less.
    assert busy[0] < busy[1] <= 1.05 * iteration[0], (busy, iteration)
