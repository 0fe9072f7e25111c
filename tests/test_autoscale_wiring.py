"""The planner in the scheduler, without processes: the GBS history it sees, its decisions and their log."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.elastic.autoscaling import AutoScaler, describe, gbs_history
from jabascli.elastic.job import Scheduler
from jabascli.elastic.protocol import EpochRecord, JobStatus
from jabascli.errors import InputError
from tests.elastic_support import load, write_config
from tests.test_autoscale_e2e import autoscaled_config
from tests.test_elastic_job import Clock, commands, register


def _epoch_end(epoch: int, step: int) -> dict[str, object]:
    return {"event": "epoch", "epoch": epoch, "step": step, "train_loss": 0.7, "samples_per_s": 1.0, "time_s": 1.0}


def _adjustment(step: int, old: int, new: int) -> dict[str, object]:
    return {"event": "adjustment", "step": step, "epoch": 0, "position": 0, "old_gbs": old, "new_gbs": new}


def test_the_planner_sees_the_gbs_of_every_adjustment_point_and_a_failing_one_leaves_the_job(tmp_path: Path) -> None:
    seen: list[list[float]] = []

    def planner(status: JobStatus) -> None:
        seen.append(gbs_history(status))
        if len(seen) == 2:
            raise InputError.at(None, "profiles", "no LBS has both a memory and a computation profile")

    s = Scheduler(load(write_config(tmp_path, epochs=4)), Clock(), planner)  # type: ignore[arg-type]
    register(s, 0)
    commands(s, 0)
    events = [_adjustment(4, 32, 48), _adjustment(8, 48, 64), _epoch_end(0, 10)]
    commands(s, 0, events=[{"generation": 1, "event": e} for e in events])
    assert seen == [[48, 64]] and s.progress.gbs == 64
    assert s.status().epoch_history[0].gbs_history == [48, 64]
    commands(s, 0, events=[{"generation": 1, "event": _epoch_end(1, 20)}])  # no adjustment: its GBS counts once
    assert seen[1] == [48, 64, 64]
    assert s.state == "running" and s.message.startswith("the planner failed: profiles: no LBS")


def _status(history: list[int], allocation: list[str]) -> JobStatus:
    record = EpochRecord(
        epoch=0, step=10, gbs=history[-1], servers=allocation, train_loss=None, val_loss=None,
        samples_per_s=1.0, time_s=1.0, gbs_history=history,
    )  # fmt: skip
    return JobStatus(
        job="digits", state="running", allocation=allocation, generation=1, plan=None, gbs=history[-1], epoch=1,
        epochs=3, step=10, loss=None, restarts=0, max_restarts=3, checkpoint=None, epoch_history=[record],
    )  # fmt: skip


def test_decisions_are_logged_one_line_each_and_mapped_to_whole_servers(tmp_path: Path) -> None:
    scaler = AutoScaler(load_config(autoscaled_config(tmp_path)), dataset_size=1438)
    assert scaler(_status([32, 48], ["A"])) is None  # small GBS ahead: A alone has no cross-server all-reduce
    stay = scaler.last
    assert stay is not None and stay["servers"] == ["A"] and not stay["move"]
    assert scaler(_status([32, 48, 80, 112, 176, 256], ["A"])) == (["A", "B"], "now")  # growing: both
    move = scaler.last
    assert move is not None and move["choice"] == {"A": 1, "B": 1} and move["current"] == {"A": 1}
    assert move["predicted"]["time_s"] < min(c["time_s"] for c in move["candidates"] if c["servers"] == {"A": 1})
    lines = (tmp_path / "runs" / "digits" / "scaling.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [stay, move]
    assert describe(move).startswith("epoch 1: forecast GBS ") and "move to A,B" in describe(move)


def test_jabas_run_with_scaling_and_no_profiles_says_so_in_one_line_before_starting_anything(
    cli: CliRunner, tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    config.write_text(config.read_text() + "\n[scaling]\nenabled = true\n")
    result = cli.invoke(app, ["run", "-c", str(config)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "memory profile folder does not exist" in lines[0], result.output
    assert not (tmp_path / "runs" / "digits" / "logs").exists()  # no scheduler or agent was started
