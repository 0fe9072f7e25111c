"""The engine's features together: adaptive GBS (in-place plan changes) with the stop hook and restarts.

Each feature has its own tests; these check what only their combination can
break. A plan change rebuilds the per-iteration statistics all-reduce
(:class:`BufferSync`), on which the stop hook's "now" flag rides: were the
flag left behind, rank 0 would stop alone and the others hang or fail in their
next collective. And a restart after a GBS change must resume at that GBS and
LR factor, on the same samples.

The job is the adaptive one of ``tests/test_adaptive_engine.py``: 2 real gloo
trainers with 7 workers; a similarity target far below what the learnable tiny
workload shows shrinks the GBS at steps 2 (28 -> 12) and 4 (12 -> 6, LBS 4 -> 3).
The trigger lives in the workload, so it fires at a known iteration: the first
training micro-batch of LBS 3 (iteration 5, after both changes).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.trainer_env import CONTROL_FILE_ENV
from tests.engine_support import TRAINER_ENV, WORKLOAD, checkpoint_of, load, max_abs_diff, write_job
from tests.test_adaptive_engine import epochs_used

SAMPLES, GBS_START, GBS_MIN = 150, 28, 6
BATCHING = {
    "metric": "similarity",
    "similarity_target": 0.01,
    "adjust_rate": 0.5,
    "adjust_interval": 2,
    "gbs_min": GBS_MIN,
    "lr_scaling": "linear",
}

# Once per marker file, on rank `trigger_rank`'s first training micro-batch of LBS 3 (iteration 5):
# "now" writes the stop request into the control file, then sleeps past the control's poll interval
# (as a slow iteration would) so that rank 0 surely reads it at the start of iteration 6; "crash"
# dies (os._exit, as a segfault would).
TRIGGERED = (
    WORKLOAD
    + """
from jabascli.engine.control import POLL_S

_plain_loss = loss


def loss(output, target):
    trigger = _OPTIONS.get("trigger")
    if (
        trigger
        and torch.is_grad_enabled()
        and os.environ.get("RANK") == str(_OPTIONS["trigger_rank"])
        and len(target) == 3
        and not os.path.exists(_OPTIONS["marker"])
    ):
        open(_OPTIONS["marker"], "w").close()
        if trigger == "crash":
            os._exit(3)
        with open(_OPTIONS["control"], "w") as f:
            f.write("now\\n")
        import time

        time.sleep(2 * POLL_S)
    return _plain_loss(output, target)
"""
)


def _job(folder: Path, trigger: str, trigger_rank: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.py").write_text(TRIGGERED)
    (folder / "record").mkdir()
    options = {
        "samples": SAMPLES,
        "learnable": True,
        "dropout": 0.0,
        "record": str(folder / "record"),
        "trigger": trigger,
        "trigger_rank": trigger_rank,
        "marker": str(folder / "triggered"),
        "control": str(folder / "control"),
    }
    return write_job(folder, [(3, 1), (1, 0)], lbs=4, options=options, epochs=2, batching=BATCHING)


def _check_exact(folder: Path, final: dict[str, Any], samples_once: bool) -> None:
    """The parameters equal the reference following the recorded GBS schedule; with ``samples_once``, the
    trainers loaded no sample twice in an epoch (a restart redoes the iterations after its checkpoint)."""
    loaded = load(folder / "job.toml")
    history = final["progress"]["gbs_history"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
    if not samples_once:
        return
    used = epochs_used(folder / "record", 2)
    assert len(used) == 2
    for samples in used:
        assert max(Counter(samples).values()) == 1  # not even across the stop
        assert 0 <= SAMPLES - len(samples) < GBS_MIN  # all but the remainder at the epoch's final GBS


def test_a_now_request_after_plan_changes_stops_every_rank_together_and_resumes_at_the_adapted_gbs(
    tmp_path: Path,
) -> None:
    loaded = load(_job(tmp_path, "now", trigger_rank=0))
    env = {**TRAINER_ENV, CONTROL_FILE_ENV: str(tmp_path / "control")}
    events: list[dict[str, Any]] = []
    result = run_local(loaded, TrainOptions(bucket_cap_mb=0.0005, metrics=False), events.append, env)

    # Requested during iteration 5, read by rank 0 before iteration 6, whose all-reduce carries the flag
    # (under the plan of step 4's change); every rank reads it at the end of iteration 7 and exits 0.
    changes = [(e["step"], e["old_gbs"], e["new_gbs"]) for e in events if e["event"] == "adjustment" and e["changed"]]
    assert changes[:2] == [(2, 28, 12), (4, 12, 6)]
    assert result.done["stopped"] and result.done["step"] == 7
    assert [e["step"] for e in events if e["event"] == "stopping"] == [7]
    saved = checkpoint_of(loaded)
    history = saved["progress"]["gbs_history"]
    assert [(h["gbs"], h["lbs"]) for h in history][:3] == [(28, 4), (12, 4), (6, 3)]
    ends = [h["step"] for h in history[1:]] + [7]  # each GBS ran from its entry's step to the next one's
    done_samples = sum(h["gbs"] * (end - h["step"]) for h, end in zip(history, ends, strict=True))
    assert (saved["progress"]["epoch"], saved["progress"]["step"]) == (0, 7)
    assert saved["progress"]["position"] == done_samples  # mid-epoch: the resumed run deals the rest
    plan = saved["adaptive"]["plan"]
    assert (plan["gbs"], plan["lbs"]) == (history[-1]["gbs"], history[-1]["lbs"])
    assert saved["adaptive"]["lr"]["factor"] == pytest.approx(history[-1]["gbs"] / GBS_START)  # linear scaling

    (tmp_path / "control").unlink()  # served: the resumed run is not asked to stop
    events.clear()
    done = run_local(loaded, TrainOptions(resume=checkpoint_folder(loaded), metrics=False), events.append, env).done
    start = next(e for e in events if e["event"] == "start")
    assert (start["gbs"], start["lbs"], start["step"]) == (plan["gbs"], plan["lbs"], 7)
    assert not done["stopped"]
    final = checkpoint_of(loaded)
    assert final["progress"]["gbs_history"][: len(history)] == history
    _check_exact(tmp_path, final, samples_once=True)


def test_max_restarts_resumes_an_adaptive_job_at_its_adapted_gbs_and_ends_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    loaded = load(_job(tmp_path, "crash", trigger_rank=1))  # rank 1 dies in iteration 5
    events: list[dict[str, Any]] = []
    options = TrainOptions(checkpoint_every=3, bucket_cap_mb=0.0005, metrics=False)
    result = run_local(loaded, options, events.append, TRAINER_ENV, max_restarts=1)
    assert len([e for e in events if e["event"] == "restart"]) == 1
    starts = [e for e in events if e["event"] == "start"]
    # The checkpoint of step 3 holds the GBS of step 2's change, 12, at LBS 4.
    assert [(s["step"], s["gbs"], s["lbs"]) for s in starts] == [(0, 28, 4), (3, 12, 4)]
    assert not result.done["stopped"]
    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    assert all(h["lr_factor"] == pytest.approx(h["gbs"] / GBS_START) for h in history)
    _check_exact(tmp_path, final, samples_once=False)

    # An uninterrupted run takes the same adaptive decisions: the restart changed nothing.
    again = tmp_path / "again"
    uninterrupted = load(_job(again, "", trigger_rank=1))
    run_local(uninterrupted, TrainOptions(bucket_cap_mb=0.0005, metrics=False), None, TRAINER_ENV)
    plain = checkpoint_of(uninterrupted)
    assert [(h["step"], h["gbs"], h["lbs"]) for h in plain["progress"]["gbs_history"]] == [
        (h["step"], h["gbs"], h["lbs"]) for h in history
    ]
    diffs = max_abs_diff(final["model"], plain["model"])
    assert max(diffs.values()) <= 1e-9, diffs
