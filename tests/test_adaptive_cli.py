"""What the user sees of adaptive batching: bad [batching] input, and a job that adapts under `jabas run`."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.cli.train import _adjustment_line
from tests.conftest import run_jabas
from tests.engine_support import write_job

ADAPTIVE = {"metric": "similarity", "adjust_interval": 2}


@pytest.mark.parametrize(
    ("batching", "field", "words"),
    [
        ({"gbs_min": 64, "gbs_max": 32}, "batching.gbs_min", "above the upper bound 32"),
        ({"gbs_min": 8, "gbs_max": 32, "initial_gbs": 48}, "batching.initial_gbs", "48 is above gbs_max 32"),
        ({"metric": "goodput", "gbs_min": 8, "gbs_max": 32}, "batching.metric", "goodput needs"),
        ({"gbs_max": 1}, "batching.gbs_max", "below the smallest reachable GBS (2, one sample on each of the 2 ranks)"),
        ({"metric": "speed"}, "batching.metric", "'goodput'"),
        ({"lr_scaling": "cubic"}, "batching.lr_scaling", "'adascale'"),
    ],
)
def test_bad_batching_input_is_one_line_and_exit_2_before_any_trainer_starts(
    tmp_path: Path, batching: dict[str, Any], field: str, words: str
) -> None:
    config = write_job(tmp_path, [(1, 0), (1, 0)], batching={**ADAPTIVE, **batching})
    result = CliRunner().invoke(app, ["run", "-c", str(config)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and words in lines[0], result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()  # nothing started


def test_one_worker_grows_to_two_and_the_run_reports_every_adjustment(tmp_path: Path) -> None:
    # W = 1: nothing to split, so the first adjustment grows the GBS to two workers; then it measures.
    batching = {**ADAPTIVE, "gbs_min": 4, "gbs_max": 12, "similarity_target": 0.5}
    config = write_job(tmp_path, [(1, 0)], options={"samples": 60, "learnable": True}, batching=batching)
    result = run_jabas("run", "-c", str(config), "--json")
    assert result.returncode == 0, result.stderr
    epochs = json.loads(result.stdout)
    adjustments = [a for e in epochs for a in e["adjustments"]]
    first = adjustments[0]
    assert (first["step"], first["old_gbs"], first["new_gbs"], first["similarity"]) == (2, 4, 8, None)
    assert first["plan"] == "s0:1GPU,VSW:1,GA:1" and first["lr_factor"] == pytest.approx(2**0.5)  # sqrt, the default
    assert all(a["similarity"] is not None for a in adjustments[1:])  # two workers: measured
    assert all(4 <= a["new_gbs"] <= 12 for a in adjustments)

    run = tmp_path / "runs" / "job"
    with (run / "adjustments.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [a["step"] for a in adjustments]
    assert [int(r["new_gbs"]) for r in rows] == [a["new_gbs"] for a in adjustments]
    kinds = {json.loads(line)["kind"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert kinds == {"step", "epoch", "adjustment"}
    with (run / "steps.csv").open() as f:
        gbs = {int(r["gbs"]) for r in csv.DictReader(f)}  # steps.csv keeps its GBS per row
    assert gbs and gbs <= {4} | {a["new_gbs"] for a in adjustments}


def test_the_run_display_line_of_an_adjustment() -> None:
    event = {"step": 40, "old_gbs": 80, "new_gbs": 96, "new_lbs": 16, "plan": "fast:2GPU,VSW:2,GA:0", "changed": True}
    event.update(similarity=0.031, noise_scale=412.3, lr_factor=1.2, reason="grow")
    line = _adjustment_line(event)
    assert line == "step 40: GBS 80 -> 96 (LBS 16; fast:2GPU,VSW:2,GA:0), similarity 0.031, noise scale 412, LR x1.2"
    kept = _adjustment_line({**event, "changed": False, "reason": "keep: no plan ..."})
    assert kept.startswith("step 40: GBS stays 80 (keep: no plan ...)")
