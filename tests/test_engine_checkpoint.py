"""Checkpoints: killed mid-epoch, resumed by another world size and configuration, still exact."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.engine.checkpoint import CheckpointState, Progress, read_checkpoint, save_checkpoint
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import InputError, RuntimeFailure
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

LBS = 4
OPTIONS = {"optimizer": "adam", "samples": 10 * 20 + 5}  # GBS 20: 10 iterations per epoch, 2 epochs


def test_a_killed_job_resumes_mid_epoch_under_another_world_size_and_equals_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # Two trainers, rank 1 emulated 40x slower, so that rank 0 is killed long before the end.
    servers = [
        {"name": "fast", "device_type": "cpu", "devices": 1, "vsw": 2, "ga": 1},
        {
            "name": "slow",
            "device_type": "cpu",
            "devices": 1,
            "vsw": 1,
            "ga": 0,
            "emulate": {"slowdown": 40.0, "memory_bytes": 10**9},
        },
    ]
    first = write_job(
        tmp_path / "a",
        [(2, 1), (1, 0)],
        lbs=LBS,
        options=OPTIONS,
        weight_sync="overlap",
        vsw_strategy="streams",
        servers=servers,
    )
    loaded = load(first)
    killed: list[int] = []

    def kill_after_first_checkpoint(event: dict[str, Any]) -> None:
        if event["event"] == "start":
            killed.append(event["pid"])
        elif event["event"] == "checkpoint" and len(killed) == 1:
            os.kill(killed[0], signal.SIGKILL)
            killed.append(event["step"])

    with pytest.raises(RuntimeFailure, match="trainer rank 0 was killed by signal 9"):
        run_local(
            loaded, TrainOptions(checkpoint_every=3, bucket_cap_mb=0.0005), kill_after_first_checkpoint, TRAINER_ENV
        )
    saved = read_checkpoint(checkpoint_folder(loaded))
    progress = Progress(**saved["progress"])
    assert 3 <= progress.step < 10 and progress.epoch == 0 and progress.position == 20 * progress.step  # mid-epoch
    assert saved["plan"]["assignments"][0]["vsw"] == 2 and saved["lr_scheduler"] is not None
    assert {"torch", "python", "numpy"} <= saved["rng"].keys() and saved["config"]["job"]["lbs"] == LBS
    assert saved["progress"]["gbs_history"] == [
        {
            "step": 0,
            "epoch": 0,
            "position": 0,
            "gbs": 20,
            "lbs": 4,
            "plan": "fast:1GPU,VSW:2,GA:1 slow:1GPU,VSW:1,GA:0",
            "lr_factor": 1.0,
        }
    ]

    # Three trainers, other (VSW, GA) and weight sync, same LBS and GBS.
    second = write_job(tmp_path / "b", [(1, 0), (1, 1), (1, 1)], lbs=LBS, options=OPTIONS, vsw_strategy="sequential")
    resumed = load(second)
    events: list[dict[str, Any]] = []
    run_local(resumed, TrainOptions(resume=checkpoint_folder(loaded), metrics=False), events.append, TRAINER_ENV)
    start = next(e for e in events if e["event"] == "start")
    assert (start["step"], start["position"], start["world_size"]) == (progress.step, progress.position, 3)

    final = checkpoint_of(resumed)
    assert final["progress"]["step"] == 20 and [h["gbs"] for h in final["progress"]["gbs_history"]] == [20, 20]
    reference, _ = reference_run(resumed, load_plan(resumed), steps=20)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def _other_model_checkpoint(store: CheckpointStore) -> Path:
    model = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 4)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = CheckpointState(model, optimizer, scheduler=None, progress=Progress(), workload="other", config={}, plan={})
    _, path = save_checkpoint(store, state)
    return path


def test_a_checkpoint_of_another_model_is_refused_and_nothing_is_overwritten(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(1, 0)], lbs=LBS, options=OPTIONS)
    loaded = load(config)
    mine = CheckpointStore(checkpoint_folder(loaded)).write(b"the job's own checkpoint", step=3, epoch=0)
    other = _other_model_checkpoint(CheckpointStore(tmp_path / "other"))
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    cli = CliRunner()
    for command in ("run", "train"):
        result = cli.invoke(app, [command, "-c", str(config), "--resume", str(other)])
        assert result.exit_code == 2, result.output
        assert f"{other}: model: checkpoint is of another model (workload 'other')" in result.stderr
        assert "tensors differ" in result.stderr and "Traceback" not in result.output
        result = cli.invoke(app, [command, "-c", str(config), "--resume", str(tmp_path / "garbage.pt")])
        assert result.exit_code == 2 and "corrupt or not a checkpoint" in result.stderr
    assert mine.read_bytes() == b"the job's own checkpoint"
    assert not (tmp_path / "runs").exists()


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = _other_model_checkpoint(store)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    class Unsaveable:
        def state_dict(self) -> dict[str, Any]:
            return {"f": lambda: None}

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(Exception, match="lambda"):
        save_checkpoint(store, CheckpointState(model, optimizer, Unsaveable(), Progress(), "x", config={}, plan={}))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert read_checkpoint(tmp_path)["workload"] == "other" and read_checkpoint(path)["workload"] == "other"
    with pytest.raises(InputError, match="checkpoint not found"):
        read_checkpoint(tmp_path / "missing.pt")
