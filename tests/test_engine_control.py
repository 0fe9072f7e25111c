"""The stop hook (engine/control.py): every rank stops after the same iteration, and training resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jabascli.engine.control import StopControl, read_request
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.trainer_env import CONTROL_FILE_ENV
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

TWO = [(3, 1), (1, 0)]  # 7 workers over 2 ranks
ONE = [(7, 0)]  # the same GBS on one rank
LBS = 4
GBS = LBS * 7
STEPS_PER_EPOCH = 5


def _job(folder: Path, ranks: list[tuple[int, int]]) -> Path:
    options = {"samples": STEPS_PER_EPOCH * GBS + 3}  # a remainder the epoch drops
    return write_job(folder, ranks, lbs=LBS, options=options, epochs=2, weight_sync="sequential")


@pytest.mark.slow
def test_a_now_request_stops_every_rank_after_the_same_iteration_and_training_resumes_exactly(tmp_path: Path) -> None:
    loaded = load(_job(tmp_path, TWO))
    control = tmp_path / "control"
    control.write_text("now\n")  # there from the start: rank 0 raises the flag in iteration 1
    events: list[dict] = []
    result = run_local(
        loaded, TrainOptions(metrics=False), events.append, {**TRAINER_ENV, CONTROL_FILE_ENV: str(control)}
    )
    # Every rank read iteration 1's summed flag at the end of iteration 2, and exited 0 there.
    assert result.done["stopped"] and result.done["step"] == 2
    assert [e["step"] for e in events if e["event"] == "stopping"] == [2]
    saved = checkpoint_of(loaded)["progress"]
    assert (saved["epoch"], saved["position"], saved["step"]) == (0, 2 * GBS, 2)

    # Resume on one rank at the same GBS: it ends where an uninterrupted run ends.
    resumed = load(_job(tmp_path, ONE))
    done = run_local(resumed, TrainOptions(resume=checkpoint_folder(resumed), metrics=False), None, TRAINER_ENV).done
    assert not done["stopped"] and done["step"] == 2 * STEPS_PER_EPOCH
    reference, _ = reference_run(loaded, load_plan(loaded), steps=2 * STEPS_PER_EPOCH)
    diffs = max_abs_diff(checkpoint_of(resumed)["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def test_an_epoch_request_stops_at_the_epoch_end(tmp_path: Path) -> None:
    loaded = load(_job(tmp_path, TWO))
    control = tmp_path / "control"
    control.write_text("epoch")
    events: list[dict] = []
    env = {**TRAINER_ENV, CONTROL_FILE_ENV: str(control)}
    result = run_local(loaded, TrainOptions(metrics=False), events.append, env)
    assert result.done["stopped"] and result.done["step"] == STEPS_PER_EPOCH
    assert [r["epoch"] for r in result.done["results"]] == [0]
    # Training stopped once the epoch was validated, which it would have been without the stop: a
    # move's downtime (from `stopping` on) leaves it out.
    kinds = [e["event"] for e in events]
    assert kinds.index("stopping") > kinds.index("epoch"), kinds
    saved = checkpoint_of(loaded)["progress"]
    assert (saved["epoch"], saved["position"]) == (1, 0)


def test_without_a_request_nothing_stops_and_the_flag_stays_down(tmp_path: Path) -> None:
    assert read_request(None) is None and read_request(tmp_path / "missing") is None
    (tmp_path / "junk").write_text("later please")
    assert read_request(tmp_path / "junk") is None
    control = StopControl(tmp_path / "junk", 0, torch.zeros(1, dtype=torch.float64))
    for step in range(1, 6):
        control.before_iteration()
        assert not control.after_iteration(step, epoch_end=step == 5)
    assert float(control.flag) == 0.0
