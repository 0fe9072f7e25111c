"""The ready configs of the built-in workloads: valid, faithful to the seed's settings, and runnable."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.workload import load_workload
from tests.conftest import REFERENCE, REPO

EXAMPLES = REPO / "examples"
# example file -> the seed's config of the same model (../shared/reference/jabas_config_example_<model>.json)
FULL_SIZE = {"resnet50": "resnet50", "vit": "vit", "gnmt": "gnmt", "faster_rcnn": "faster_r_cnn"}
TINY = ["resnet_tiny", "vit_tiny", "gnmt_tiny", "faster_rcnn_tiny"]
# Like the quick start: real (or generated) data, a small model.
REAL_DATA = ["mnist1d", "digits_adaptive", "two_servers", "hybrid_gpt"]


@pytest.mark.parametrize("name", [*FULL_SIZE, *TINY, *REAL_DATA])
def test_example_passes_jabas_validate(cli: CliRunner, name: str) -> None:
    result = cli.invoke(app, ["validate", "-c", str(EXAMPLES / f"{name}.toml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "is valid" in result.output


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_example_mirrors_the_seed(name: str) -> None:
    seed_file = REFERENCE / f"jabas_config_example_{FULL_SIZE[name]}.json"
    if not seed_file.is_file():
        pytest.skip(f"seed config not found at {seed_file} (it sits in ../shared/reference beside the repo)")
    seed = json.loads(seed_file.read_text())
    cfg = load_config(EXAMPLES / f"{name}.toml").config
    assert (cfg.batching.gbs_min, cfg.batching.gbs_max) == (
        seed["batch_size_lower_bound"],
        seed["batch_size_upper_bound"],
    )
    assert cfg.batching.similarity_target == seed["similarity_target"]
    assert cfg.scaling.allocation_unit == int(seed.get("resource_alloc_unit", "1gpu").removesuffix("gpu"))
    assert cfg.cluster.available_servers == seed["available_servers"]
    workers = sum(s.devices * s.vsw * (s.ga + 1) for s in cfg.available())
    assert cfg.job.lbs * workers >= cfg.batching.gbs_min  # the plan-less GBS is within the bounds
    assert cfg.batching.initial_gbs == cfg.batching.gbs_min


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_example_options_build_the_model(name: str) -> None:
    cfg = load_config(EXAMPLES / f"{name}.toml").config
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    assert workload.options.get("variant") != "tiny"
    with torch.device("meta"):  # full size, without allocating or initialising its memory
        model = workload.build_model()
    assert sum(p.numel() for p in model.parameters()) > 20_000_000


@pytest.mark.parametrize("name", TINY)
def test_tiny_example_trains_one_step(name: str) -> None:
    torch.set_num_threads(1)
    cfg = load_config(EXAMPLES / f"{name}.toml").config
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    dataset = workload.train_dataset()
    assert len(dataset) == cfg.job.options["synthetic_size"]
    samples = [dataset[i] for i in range(cfg.job.lbs)]
    collate = workload.collate or torch.utils.data.default_collate
    inputs, target = collate(samples)
    model = workload.build_model()
    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = workload.loss(output, target)
    loss.backward()
    workload.optimizer(model.parameters()).step()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert len(target) == cfg.job.lbs  # one target row per sample: a trainer can count samples


def test_every_builtin_example_is_covered() -> None:
    names = {p.stem for p in EXAMPLES.glob("*.toml")} - {"quickstart"}
    assert names == set(FULL_SIZE) | set(TINY) | set(REAL_DATA), "add new examples to this test"


def test_example_data_paths_are_only_comments() -> None:
    """Full-size examples name a data path only in a comment: validate checks that data exists."""
    for name in FULL_SIZE:
        text = (EXAMPLES / f"{name}.toml").read_text()
        assert "# data = " in text and "\ndata = " not in text, name


def test_digits_read_without_scikit_learn_equal_what_scikit_learn_loads() -> None:
    """The digits workload reads scikit-learn's bundled file itself (its import costs every trainer seconds)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from jabascli.builtin_models.digits import bundled_digits

    images, labels = bundled_digits()
    expected_images, expected_labels = load_digits(return_X_y=True)
    assert images.dtype == expected_images.dtype and labels.dtype == expected_labels.dtype
    assert np.array_equal(images, expected_images) and np.array_equal(labels, expected_labels)
    code = (
        "import sys\n"
        "from jabascli.builtin_models.digits import bundled_digits\n"
        "assert bundled_digits()[0].shape == (1797, 64)\n"
        "assert 'sklearn' not in sys.modules, 'scikit-learn was imported'\n"
    )
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
