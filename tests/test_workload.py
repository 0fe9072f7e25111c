"""The workload interface and the digits workload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jabascli.errors import InputError
from jabascli.workload import builtin_workloads, load_workload
from tests.conftest import run_jabas


def test_digits_is_builtin_and_real() -> None:
    assert "digits" in builtin_workloads()
    w = load_workload("digits")
    train, val = w.train_dataset(), w.val_dataset()
    assert len(train) == 1438 and len(val) == 359  # seeded 80/20 split of 1,797 images
    x, y = train[0]
    assert x.shape == (1, 8, 8) and 0 <= int(y) < 10
    model = w.build_model()
    inputs, target = w.synthetic_batch(5)
    out = model(inputs)
    assert out.shape == (5, 10)
    assert w.loss(out, target).ndim == 0
    assert w.count_correct(out, target) is not None
    assert isinstance(w.optimizer(model.parameters()), torch.optim.SGD)


def test_workload_missing_functions_named(tmp_path: Path) -> None:
    path = tmp_path / "half.py"
    path.write_text("def build_model(options):\n    return None\n")
    with pytest.raises(InputError) as info:
        load_workload(str(path))
    line = info.value.lines()[0]
    assert str(path) in line and "train_dataset" in line and "synthetic_batch" in line


def test_workload_import_error_and_unknown_name(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(InputError, match="failed to import"):
        load_workload(str(path))
    with pytest.raises(InputError, match="unknown workload 'nope'"):
        load_workload("nope")


def test_validate_rejects_the_workloads_that_run_rejects_with_the_same_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import os\n\n\nraise RuntimeError('broken at import')\n")
    server = '[[cluster.servers]]\nname = "a"\ndevice_type = "cpu"\n'
    cases = {
        "unknown": ('workload = "no_such_workload"', "job.workload: unknown workload 'no_such_workload'"),
        "broken": (f'workload = "{tmp_path / "broken.py"}"', f"{tmp_path / 'broken.py'}: line 4: failed to import"),
    }
    for name, (line, expected) in cases.items():
        config = tmp_path / f"{name}.toml"
        config.write_text(f"[job]\n{line}\nlbs = 4\n{server}")
        validated = run_jabas("validate", "-c", str(config))
        ran = run_jabas("run", "-c", str(config))
        for result in (validated, ran):
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            [error] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            assert expected in error
        assert validated.stderr.strip() == next(x for x in ran.stderr.splitlines() if x.startswith("error: "))
        if name == "unknown":
            assert validated.stderr.startswith(f"error: {config}: job.workload: ")  # names the config file
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    result = run_jabas("validate", "-c", str(empty))
    assert result.returncode == 2 and f"{empty}: job.workload: no workload given" in result.stderr
