"""What real jobs need from the engine (issue #15): precision, clipping, memory limits, loader workers.

Exactness of clipping, bf16, fp16 and loader workers is tested against the reference in
``test_engine_exactness.py``; here: bad input, and emulated out-of-memory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from jabascli.cli.app import app
from tests.engine_support import TRAINER_ENV, write_job

BAD_JOB_KEYS = [
    pytest.param({"precision": "fp8"}, None, "job.precision", id="unknown-precision"),
    pytest.param({"clip_grad_norm": 0}, None, "job.clip_grad_norm", id="clip-zero"),
    pytest.param({"clip_grad_norm": -1.5}, None, "job.clip_grad_norm", id="clip-negative"),
    pytest.param({"loader_workers": -1}, None, "job.loader_workers", id="negative-loader-workers"),
    pytest.param({"precision": "fp16"}, "Tesla K80", "fp16 is not supported by Tesla K80", id="fp16-on-a-k80"),
    pytest.param({"precision": "bf16"}, "Tesla V100-PCIE-16GB", "bf16 is not supported by Tesla V100", id="bf16-v100"),
]


@pytest.mark.parametrize(("job_keys", "device_type", "expected"), BAD_JOB_KEYS)
def test_bad_precision_clip_or_loader_workers_exit_2_before_any_trainer_starts(
    tmp_path: Path, job_keys: dict[str, Any], device_type: str | None, expected: str
) -> None:
    servers = None
    if device_type is not None:
        servers = [{"name": "gpu0", "device_type": device_type, "devices": 1, "vsw": 1, "ga": 0}]
    config = write_job(tmp_path, [(1, 0)], job_keys=job_keys, servers=servers)
    for command in ("validate", "run"):
        result = CliRunner().invoke(app, [command, "-c", str(config)])
        if command == "validate" and device_type is not None:
            assert result.exit_code == 0, result.output  # the config is valid; the device is the problem
            continue
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.stderr.splitlines() if not line.startswith("note:")]
        assert len(lines) == 1 and str(config) in lines[0] and expected in lines[0], result.stderr
        assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


def test_an_emulated_device_over_its_memory_budget_fails_as_a_gpu_would(tmp_path: Path, monkeypatch: Any) -> None:
    for key, value in TRAINER_ENV.items():
        monkeypatch.setenv(key, value)
    outcomes = {}
    # The model, its gradient buckets and its BatchNorm statistics take ~7 kB per rank; an iteration at
    # LBS 4 adds activations, gradients and SGD's momentum: 20 kB is too little, 1 MB plenty.
    for budget in (20_000, 1_000_000):
        emulate = {"slowdown": 1.0, "memory_bytes": budget}
        servers = [{"name": "emu", "device_type": "emulated-p100", "devices": 1, "vsw": 2, "ga": 0, "emulate": emulate}]
        config = write_job(tmp_path / str(budget), [(2, 0)], servers=servers, options={"samples": 100}, epochs=1)
        outcomes[budget] = CliRunner().invoke(app, ["run", "-c", str(config), "--max-steps", "4"])
    over = outcomes[20_000]
    assert over.exit_code == 1, over.output
    match = re.search(
        r"out of memory on emulated device emu \(emulated-p100\), rank \d: peak ([\d,]+) bytes "
        r"over budget 20,000 bytes",
        over.stderr,
    )
    assert match is not None, over.stderr
    assert int(match.group(1).replace(",", "")) > 20_000
    assert "Traceback" not in over.stderr
    assert outcomes[1_000_000].exit_code == 0, outcomes[1_000_000].output


def test_a_new_iteration_stream_never_gets_batches_prefetched_for_the_old_one() -> None:
    from torch.utils.data import TensorDataset

    from jabascli.engine.loader import MicroBatchFeed
    from jabascli.engine.plan import RankPlan, TrainingPlan
    from jabascli.engine.sampler import IIDPSampler

    feed = MicroBatchFeed(TensorDataset(torch.arange(64.0), torch.arange(64)), None, torch.device("cpu"), 2)
    sampler = IIDPSampler(64, 0)
    old = TrainingPlan(4, (RankPlan(0, "s", "cpu", 2, 0),))  # LBS 4: micro-batches at positions 0, 4, 8 ...
    new = TrainingPlan(8, (RankPlan(0, "s", "cpu", 1, 1),))  # a plan change: LBS 8 at positions 8, 16 ...
    first = next(feed.follow(sampler.rank_iterations(0, 0, old, 0)))
    feed.take(first.micro_batches[0])  # meanwhile the workers load the old plan's next micro-batches
    taken = 0
    for iteration in feed.follow(sampler.rank_iterations(0, 8, new, 0)):
        for mb in iteration.micro_batches:
            _, target = feed.take(mb)
            assert target.tolist() == mb.indices  # the old plan's batch at position 8 had 4 of them
            taken += 1
    assert taken == 6  # 3 iterations of GBS 16 fit in the 56 samples left, 2 micro-batches each


def test_a_plan_from_profiles_of_another_precision_is_refused_before_any_trainer_starts(tmp_path: Path) -> None:
    from jabascli.config import load_config
    from jabascli.profiles import MemoryProfile, write_memory_profile

    config = write_job(tmp_path, [(1, 0)], plan_file=True, job_keys={"precision": "bf16"})
    memory = load_config(config).profile_dirs().memory
    write_memory_profile(memory, "s0", MemoryProfile(gpu_type="cpu", total_memory=1, lbs=4, max_num_models=1))
    assert CliRunner().invoke(app, ["run", "-c", str(config)]).exit_code == 0  # no precision recorded: unknown
    measured = MemoryProfile(gpu_type="cpu", total_memory=1, lbs=4, max_num_models=1, precision="fp32")
    path = write_memory_profile(memory, "s0", measured)
    result = CliRunner().invoke(app, ["run", "-c", str(config), "--fresh"])  # the job is done: train it anew
    assert result.exit_code == 2, result.output
    assert f"{path.parent}: precision: measured in fp32, but [job] precision is bf16" in result.stderr
