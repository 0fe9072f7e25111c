"""Faults on purpose (``JABAS_FAULT``) and what they do to a job: a lost or hung rank fails the others
within ``[scheduler] collective_timeout_s``, and the job restarted from its checkpoint ends exact."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jabascli.engine.faults import FAULT_ENV, Fault, FaultInjector, parse_faults
from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import InputError
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

TWO = [(2, 1), (1, 0)]
LBS, GBS = 4, 20  # (VSW 2, GA 1) and (VSW 1, GA 0): 5 workers


def test_faults_parse_and_bad_ones_name_the_variable() -> None:
    assert parse_faults("1:5:kill, 0:2:hang") == [Fault(1, 5, "kill"), Fault(0, 2, "hang")]
    for bad in ("1:5", "1:0:exit", "x:5:exit", "1:5:explode", "1:5:exit:now"):
        with pytest.raises(InputError, match=f"environment: {FAULT_ENV}: '{bad}': expected RANK:STEP:KIND"):
            parse_faults(bad)


def test_a_fault_fires_once_per_job_on_its_rank_only(tmp_path: Path) -> None:
    mine = FaultInjector(parse_faults("1:3:exit,0:3:exit"), rank=1, folder=tmp_path / "faults")
    assert mine.faults == [Fault(1, 3, "exit")]
    assert mine._first_time(mine.faults[0]) and not mine._first_time(mine.faults[0])
    assert (tmp_path / "faults" / "rank1-step3-exit").is_file()


def _job(folder: Path, timeout_s: float) -> Path:
    path = write_job(folder, TWO, lbs=LBS, options={"samples": 6 * GBS + 3}, epochs=2)
    with path.open("a") as config:
        config.write(f"\n[scheduler]\ncollective_timeout_s = {timeout_s}\n")
    return path


@pytest.mark.parametrize("kind", ["hang", "kill"])
def test_a_lost_or_hung_rank_fails_the_job_in_bounded_time_and_a_restart_ends_exact(tmp_path: Path, kind: str) -> None:
    """Rank 1 hangs (or is SIGKILLed) as it begins step 5; rank 0 waits in step 5's all-reduce. It raises
    within the collective timeout, `jabas run --max-restarts 1` restarts both from step 4's checkpoint, and
    the job ends as one process that never failed."""
    loaded = load(_job(tmp_path, timeout_s=3.0))
    events: list[dict] = []
    began = time.monotonic()
    result = run_local(
        loaded,
        TrainOptions(checkpoint_every=2, metrics=False),
        events.append,
        {**TRAINER_ENV, FAULT_ENV: f"1:5:{kind}"},
        max_restarts=1,
    )
    [restart] = [e for e in events if e["event"] == "restart"]
    assert restart["resume"].endswith("checkpoint-4.pt"), restart
    assert [s["step"] for s in events if s["event"] == "start"] == [0, 4]
    assert result.done["step"] == 12 and not result.done["stopped"]
    assert time.monotonic() - began < 120  # a hang without the timeout would never end (pytest's limit: 600 s)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(checkpoint_of(loaded)["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs
