"""What real jobs need from the engine (issue #15): precision, clipping, memory limits, loader workers.

Exactness of clipping, bf16, fp16 and loader workers is tested against the reference in
``test_engine_exactness.py``; here: bad input, and emulated out-of-memory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
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
