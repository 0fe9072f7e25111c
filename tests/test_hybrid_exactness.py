"""Hybrid layouts of IIDP (`[parallel]`) on real gloo processes equal the single-process reference.

Sharding (FSDP2): tiny GPT and tiny ViT in float64, 12 iterations over two epochs (each epoch drops a remainder),
Adam and SGD + momentum, ranks with unequal micro-batch counts (a fast replica running more
micro-batches than a slow one) and equal ones, with and without activation checkpointing: every
parameter within 1e-9 of :func:`jabascli.engine.reference.reference_run`. Tensor parallel: tiny GPT
and tiny ViT as one replica of ``tp = 2`` on a server of two devices, the replica running both devices'
micro-batches. Pipeline: tiny GPT and tiny ViT as one replica of ``pp = 2`` with stages of 3 and 1 blocks,
1F1B and GPipe.
``tp = 2`` x ``pp = 2`` on 4 ranks; 2 replicas of ``tp = 2`` on two servers, one an emulated slow
device with another ``ga`` (plain, or sharded over the DP dim); per-block ``layers`` mixing sharded
and plain blocks with checkpointing. The float32 case holds within 1e-4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.forkserver import Unavailable, shared_server
from jabascli.net import free_port
from jabascli.workload import workload_of
from tests.conftest import REPO
from tests.engine_support import TRAINER_ENV, load, max_abs_diff

LBS = 2
WORKLOAD = Path(__file__).with_name("hybrid_workload.py")
BASE_OPTIONS = {"gpt": {"variant": "tiny", "context": 8}, "vit": {"variant": "tiny", "image_size": 16}}


def write_config(
    folder: Path,
    base: str,
    optimizer: str,
    ga: list[int],
    parallel: dict[str, Any],
    devices: int = 1,
    slowdown: dict[int, float] | None = None,
    float32: bool = False,
) -> Path:
    """A job whose server ``i`` has ``devices`` ranks, each running ``ga[i] + 1`` micro-batches; 6 iterations
    an epoch. ``slowdown``: server index to the slowdown of its emulated devices."""
    gbs = LBS * devices * sum(g + 1 for g in ga)
    options = {"base": base, "optimizer": optimizer, "synthetic_size": 6 * gbs + 3, **BASE_OPTIONS[base]}
    if float32:
        options["float32"] = True
    servers: list[dict[str, Any]] = [
        {"name": f"s{i}", "device_type": "cpu", "devices": devices, "ga": g} for i, g in enumerate(ga)
    ]
    for i, factor in (slowdown or {}).items():
        servers[i] |= {"device_type": "slow", "emulate": {"slowdown": factor, "memory_bytes": 10**9}}
    config = {
        "job": {"workload": str(WORKLOAD), "epochs": 2, "seed": 3, "lbs": LBS, "options": options},
        "cluster": {"servers": servers},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
        "parallel": parallel,
    }
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


SUPPORT = "tests.hybrid_support:command"


def run_ranks(config: Path, world: int, out: Path, *args: str) -> None:
    """``world`` processes of tests/hybrid_support.py on ``config`` (``args``: its checkpoint options), forked
    as `jabas run` forks its trainers (jabascli/forkserver.py), each writing to ``out``'s folder's rank log."""
    port = free_port()
    env = {**os.environ, **TRAINER_ENV, "PYTHONPATH": str(REPO)}
    logs = [out.parent / f"{out.name}.rank{r}.log" for r in range(world)]
    ranks = []
    for r, log in enumerate(logs):
        argv = [str(config), str(r), str(world), str(port), str(out), *args]
        with log.open("wb") as output:
            try:
                ranks.append(shared_server().spawn(SUPPORT, argv, env, output.fileno(), cwd=str(REPO)))
            except Unavailable:
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.hybrid_support", *argv],
                        cwd=REPO,
                        env=env,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                    )
                )
    codes = [p.wait(timeout=300) for p in ranks]
    assert all(code == 0 for code in codes), [log.read_text()[-3000:] for log in logs]


def train_sharded(config: Path, world: int, out: Path, stages: int = 1) -> dict[str, torch.Tensor]:
    run_ranks(config, world, out)
    if stages == 1:
        return torch.load(out, weights_only=True)
    whole: dict[str, torch.Tensor] = {}
    for r in range(world):  # every stage's part, written by its rank
        whole.update(torch.load(f"{out}.{r}", weights_only=True))
    return whole


CASES = [
    pytest.param("gpt", "adam", [2, 0], {"sharding": "full"}, id="gpt-adam-full-2-ranks-unequal"),
    pytest.param(
        "gpt", "sgd", [1, 0, 2], {"sharding": "grads"}, id="gpt-sgd-grads-3-ranks-unequal", marks=pytest.mark.slow
    ),
    pytest.param("vit", "sgd", [1, 1], {"sharding": "full"}, id="vit-sgd-full-2-ranks-equal", marks=pytest.mark.slow),
    pytest.param(
        "vit",
        "adam",
        [0, 1, 2],
        {"sharding": "full", "checkpointing": [0, 2]},
        id="vit-adam-full-3-ranks-ckpt",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("base", "optimizer", "ga", "parallel"), CASES)
def test_sharded_ranks_equal_the_single_process_reference(
    tmp_path: Path, base: str, optimizer: str, ga: list[int], parallel: dict[str, Any]
) -> None:
    loaded = load(write_config(tmp_path, base, optimizer, ga, parallel))
    trained = train_sharded(loaded.path, len(ga), tmp_path / "model.pt")
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
    # Not vacuous: training moved the parameters away from where they started.
    torch.manual_seed(loaded.config.job.seed)
    from jabascli.workload import load_workload

    start = load_workload(loaded.config.job.workload, loaded.config.job.options).build_model().state_dict()
    assert max(max_abs_diff(trained, start).values()) > 1e-3


@pytest.mark.parametrize(
    ("base", "optimizer"),
    [
        pytest.param("gpt", "adam", id="gpt-adam"),
        pytest.param("gpt", "sgd", id="gpt-sgd", marks=pytest.mark.slow),
        pytest.param("vit", "adam", id="vit-adam"),
    ],
)
def test_tensor_parallel_replica_equals_the_single_process_reference(tmp_path: Path, base: str, optimizer: str) -> None:
    loaded = load(write_config(tmp_path, base, optimizer, [1], {"tp": 2}, devices=2))
    trained = train_sharded(loaded.path, 2, tmp_path / "model.pt")
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


@pytest.mark.parametrize(
    ("base", "optimizer", "schedule"),
    [
        pytest.param("gpt", "adam", "1f1b", id="gpt-adam-1f1b"),
        pytest.param("gpt", "sgd", "gpipe", id="gpt-sgd-gpipe", marks=pytest.mark.slow),
        pytest.param("vit", "sgd", "1f1b", id="vit-sgd-1f1b", marks=pytest.mark.slow),
    ],
)
def test_pipeline_of_unequal_stages_equals_the_single_process_reference(
    tmp_path: Path, base: str, optimizer: str, schedule: str
) -> None:
    """Two stages of 3 and 1 blocks (for a fast and a slow device), the replica's micro-batches pipelined."""
    parallel = {"pp": 2, "stages": [[0, 2], [3, 3]], "schedule": schedule}
    loaded = load(write_config(tmp_path, base, optimizer, [1], parallel, devices=2))
    trained = train_sharded(loaded.path, 2, tmp_path / "model.pt", stages=2)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def assert_equals_reference(loaded: Any, trained: dict[str, torch.Tensor], tolerance: float) -> None:
    """Every parameter within ``tolerance`` of the reference's 12 iterations, and training moved them."""
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= tolerance, {k: v for k, v in diffs.items() if v > tolerance}
    torch.manual_seed(loaded.config.job.seed)
    start = workload_of(loaded).build_model().state_dict()
    assert max(max_abs_diff(trained, start).values()) > 1e-3


def test_tensor_parallel_pipeline_replica_equals_the_single_process_reference(tmp_path: Path) -> None:
    """``tp = 2`` x ``pp = 2`` on 4 ranks, one replica: two stages (3 and 1 blocks), each a TP group of 2.
    (float32 and SGD + momentum: the layerwise ``tp = 2`` case and the plain ``tp``/``pp`` cases; kept out
    here for test time.)"""
    parallel = {"tp": 2, "pp": 2, "stages": [[0, 2], [3, 3]], "schedule": "1f1b"}
    loaded = load(write_config(tmp_path, "gpt", "adam", [1], parallel, devices=4))
    trained = train_sharded(loaded.path, 4, tmp_path / "model.pt", stages=4)
    assert_equals_reference(loaded, trained, 1e-9)


def test_tensor_parallel_replicas_on_unequal_servers_equal_the_single_process_reference(tmp_path: Path) -> None:
    """2 replicas of ``tp = 2``, one per server; the second server an emulated 3x slower device running
    1 micro-batch per device against the first's 3: the replicas run 6 and 2 micro-batches an iteration,
    and their gradients meet over the DP dimension. (With FSDP2 over the DP dim and float32: the
    layerwise case with ``tp = 2`` below.)"""
    path = write_config(tmp_path, "gpt", "adam", [2, 0], {"tp": 2}, devices=2, slowdown={1: 3.0})
    loaded = load(path)
    trained = train_sharded(loaded.path, 4, tmp_path / "model.pt")
    assert_equals_reference(loaded, trained, 1e-9)


LAYERWISE = [
    pytest.param(
        "gpt",
        "adam",
        [2, 0],
        1,
        {"sharding": "full", "checkpointing": [0], "layers": [{"blocks": [2, 3], "checkpointing": True}]},
        False,
        id="gpt-adam-blocks-0-1-sharded-2-3-plain-checkpointed",
    ),
    pytest.param(
        "vit",
        "sgd",
        [1, 0, 2],
        1,
        {"layers": [{"blocks": [0, 0], "sharding": "grads", "checkpointing": True}]},
        False,
        id="vit-sgd-block-0-sharded-rest-plain",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "gpt",
        "adam",
        [2, 0],
        2,
        {"tp": 2, "sharding": "full", "layers": [{"blocks": [3, 3], "tp": 1, "checkpointing": True}]},
        True,
        id="gpt-adam-float32-tp-2-sharded-block-3-whole",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("base", "optimizer", "ga", "devices", "parallel", "float32"), LAYERWISE)
def test_layerwise_strategy_equals_the_single_process_reference(
    tmp_path: Path, base: str, optimizer: str, ga: list[int], devices: int, parallel: dict[str, Any], float32: bool
) -> None:
    """Per-block ``layers`` (Galvatron's layerwise strategies) mixing FSDP2-sharded blocks and plain ones
    (whole on every replica, gradients all-reduced), with checkpointing, on replicas of unequal counts."""
    loaded = load(write_config(tmp_path, base, optimizer, ga, parallel, devices=devices, float32=float32))
    trained = train_sharded(loaded.path, len(ga) * devices, tmp_path / "model.pt")
    assert_equals_reference(loaded, trained, 1e-4 if float32 else 1e-9)


@pytest.mark.slow
def test_sharded_pipeline_replicas_equal_the_single_process_reference(tmp_path: Path) -> None:
    """2 replicas of ``pp = 2`` (stages of 3 and 1 blocks), each stage FSDP2-sharded over the replicas, which
    run 6 and 2 pipeline micro-batches: every stage's DP group issues the same collectives."""
    parallel = {"pp": 2, "stages": [[0, 2], [3, 3]], "sharding": "full"}
    loaded = load(write_config(tmp_path, "gpt", "adam", [2, 0], parallel, devices=2))
    trained = train_sharded(loaded.path, 4, tmp_path / "model.pt", stages=4)
    assert_equals_reference(loaded, trained, 1e-9)
