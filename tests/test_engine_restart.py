"""`jabas run --max-restarts`: a crashed trainer is restarted from the latest checkpoint, and training stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import RuntimeFailure
from tests.engine_support import TRAINER_ENV, WORKLOAD, checkpoint_of, load, max_abs_diff, write_job

# The tiny workload, whose rank 1 dies (os._exit, as a segfault would) in its `crash_at`-th training
# micro-step, once per marker file.
CRASHING = (
    WORKLOAD
    + """
_plain_loss = loss
_CALLS = [0]


def loss(output, target):
    if torch.is_grad_enabled() and os.environ.get("RANK") == "1":
        _CALLS[0] += 1
        marker = _OPTIONS.get("crash_marker")
        if marker and _CALLS[0] == _OPTIONS["crash_at"] and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
    return _plain_loss(output, target)
"""
)
TWO = [(3, 1), (1, 0)]  # rank 1 runs one micro-step per iteration
LBS, GBS = 4, 28


def _job(folder: Path, crash_at: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.py").write_text(CRASHING)
    options = {"samples": 5 * GBS + 3, "crash_marker": str(folder / "crashed"), "crash_at": crash_at}
    return write_job(folder, TWO, lbs=LBS, options=options, epochs=2)


@pytest.mark.slow
def test_a_crashed_trainer_restarts_from_the_latest_checkpoint_and_ends_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    loaded = load(_job(tmp_path, crash_at=5))  # dies in iteration 5; the checkpoint of step 3 is the latest
    events: list[dict] = []
    options = TrainOptions(checkpoint_every=3, metrics=False)
    result = run_local(loaded, options, events.append, TRAINER_ENV, max_restarts=1)
    [restart] = [e for e in events if e["event"] == "restart"]
    assert restart["resume"].endswith("checkpoint-3.pt")  # (the reason names whichever rank reported first)
    starts = [e for e in events if e["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 3]  # one iteration (step 4) is done twice
    assert result.done["step"] == 10 and not result.done["stopped"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=10)
    diffs = max_abs_diff(checkpoint_of(loaded)["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def test_without_restarts_left_the_failure_is_reported(tmp_path: Path) -> None:
    loaded = load(_job(tmp_path, crash_at=2))
    with pytest.raises(RuntimeFailure, match="trainer rank"):
        run_local(loaded, TrainOptions(metrics=False), None, TRAINER_ENV)
