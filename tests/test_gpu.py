"""The CUDA paths, for the first machine with a GPU (``make gpu-check``; skipped, saying why, without CUDA).

Exactness with ``streams`` VSWs on CUDA (one NCCL rank with several VSWs, and
two ranks sharing the one GPU over gloo, since NCCL refuses two ranks on one
device), bf16/fp16 on CUDA, loader workers with pinned memory, and a real
CUDA out-of-memory error in the memory profiler. Every comparison is against
:func:`~jabascli.engine.reference.reference_run` on the same GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here: these run the CUDA paths (make gpu-check on a GPU)"
    ),
]

LBS = 4
TINY_BUCKETS_MB = 0.0005


def _train(
    tmp_path: Path,
    ranks: list[tuple[int, int]],
    *,
    job_keys: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """20 iterations on the GPU (device type "gpu": not emulated, not "cpu"); the config and the start event."""
    gbs = LBS * sum(v * (g + 1) for v, g in ranks)
    servers = [
        {"name": f"g{i}", "device_type": "gpu", "devices": 1, "vsw": v, "ga": g} for i, (v, g) in enumerate(ranks)
    ]
    options = {"samples": 10 * gbs + 5, **(options or {})}
    config = write_job(
        tmp_path, ranks, lbs=LBS, options=options, vsw_strategy="streams", servers=servers, job_keys=job_keys
    )
    loaded = load(config)
    events: list[dict[str, Any]] = []
    result = run_local(
        loaded,
        TrainOptions(bucket_cap_mb=TINY_BUCKETS_MB, metrics=False),
        events.append,
        {**TRAINER_ENV, **(env or {})},
    )
    assert result.done["step"] == 20
    return loaded, next(e for e in events if e["event"] == "start")


def _diff(loaded: Any) -> float:
    reference, _ = reference_run(loaded, load_plan(loaded), steps=20, device="cuda")
    theirs = {k: v.cpu() for k, v in reference.state_dict().items()}
    return max(max_abs_diff(checkpoint_of(loaded)["model"], theirs).values())


def test_one_nccl_rank_with_streams_vsws_equals_the_reference(tmp_path: Path) -> None:
    loaded, start = _train(tmp_path, [(3, 1)])
    assert start["device"] == "cuda:0" and start["vsw_strategy"] == "streams"
    assert _diff(loaded) <= 1e-9  # float64


def test_two_ranks_sharing_the_gpu_over_gloo_equal_the_reference(tmp_path: Path) -> None:
    loaded, start = _train(tmp_path, [(3, 1), (1, 0)], env={"JABAS_SHARE_GPUS": "1"})
    assert start["device"] == "cuda:0" and start["vsw_strategy"] == "streams" and start["world_size"] == 2
    assert _diff(loaded) <= 1e-9


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cuda_equals_the_reference_in_that_precision(tmp_path: Path, precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16")
    loaded, start = _train(tmp_path, [(2, 1)], job_keys={"precision": precision}, options={"dtype": "float32"})
    assert start["precision"] == precision
    low = _diff(loaded)
    loaded.config.job.precision = "fp32"
    # Same tolerance and reasoning as on the CPU (test_engine_exactness.py): the same low-precision
    # kernels on the same inputs; only the float32 gradient sums differ in order.
    assert low <= 1e-4 and _diff(loaded) > 1000 * low, low


def test_loader_workers_on_cuda_pin_memory_and_follow_the_samples(tmp_path: Path) -> None:
    loaded, start = _train(tmp_path, [(2, 1)], options={"augment": True})
    assert start["loader_workers"] == 2  # the default for a GPU trainer
    assert _diff(loaded) <= 1e-9

    from torch.utils.data import TensorDataset

    from jabascli.engine.loader import MicroBatchFeed
    from jabascli.engine.plan import RankPlan, TrainingPlan
    from jabascli.engine.sampler import IIDPSampler

    feed = MicroBatchFeed(TensorDataset(torch.randn(64, 3), torch.arange(64)), None, torch.device("cuda"), 2)
    plan = TrainingPlan(8, (RankPlan(0, "g", "gpu", 2, 0),))
    iteration = next(feed.follow(IIDPSampler(64, 0).rank_iterations(0, 0, plan, 0)))
    assert feed._batches is not None
    _, (x, y), _ = next(feed._batches)
    assert x.is_pinned() and y.is_pinned()
    inputs, _ = feed.take(iteration.micro_batches[1])
    assert inputs.device.type == "cuda"


def _resnet_on_this_gpu(tmp_path: Path, job: str = "", server: str = "") -> Path:
    """A tiny-ResNet job on one server of this GPU, profiles in ``tmp_path/profiles``; more ``[job]``/server keys."""
    config = tmp_path / "jabas.toml"
    config.write_text(
        f'[job]\nworkload = "resnet"\noptions = {{ variant = "tiny" }}\n{job}\n[profiles]\ndir = "profiles"\n\n'
        f'[[cluster.servers]]\nname = "gpu"\ndevice_type = "{torch.cuda.get_device_name()}"\ndevices = 1\n{server}'
    )
    return config


def test_the_memory_profiler_counts_a_real_cuda_out_of_memory(tmp_path: Path) -> None:
    config = _resnet_on_this_gpu(tmp_path, server=f"memory_bytes = {256 * 2**20}\n")
    # LBS 4096 of 32x32 images: the first stage's activations alone take ~270 MB.
    result = CliRunner().invoke(
        app, ["profile", "mem", "-c", str(config), "--lbs", "4096", "--search", "static", "--json"]
    )
    assert result.exit_code == 0, result.output
    [lbs] = json.loads(result.stdout)["results"]
    assert lbs["max_num_models"] == 0
    [trial] = lbs["trials"]
    assert not trial["fits"] and "out of memory" in trial["error"].lower()


@pytest.mark.parametrize(
    "parallel",
    [{"sharding": "full", "checkpointing": "full"}, {"sharding": "grads", "checkpointing": [1, 2]}],
    ids=["sharding-full-checkpointing", "sharding-grads-some-checkpointed"],
)
def test_a_hybrid_layout_on_one_nccl_rank_equals_the_reference(tmp_path: Path, parallel: dict[str, Any]) -> None:
    """FSDP2 over NCCL and activation checkpointing on CUDA: one rank (one GPU here; NCCL refuses two ranks on
    one device), 3 micro-batches an iteration, float64 tiny GPT, 12 iterations over two epochs."""
    import tomli_w
    import tomllib

    from jabascli.engine.checkpoint import read_checkpoint
    from jabascli.engine.layout import checkpoint_folder
    from tests.test_hybrid_exactness import write_config

    path = write_config(tmp_path, "gpt", "adam", [2], parallel)
    config = tomllib.loads(path.read_text())
    config["cluster"]["servers"][0]["device_type"] = "gpu"
    path.write_bytes(tomli_w.dumps(config).encode())
    loaded = load(path)
    events: list[dict[str, Any]] = []
    result = run_local(loaded, TrainOptions(metrics=False), events.append, TRAINER_ENV)
    assert result.done["step"] == 12
    start = next(e for e in events if e["event"] == "start")
    assert start["device"] == "cuda:0" and start["layout"].startswith("sharding")
    trained = read_checkpoint(checkpoint_folder(loaded))["model"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12, device="cuda")
    theirs = {k: v.cpu() for k, v in reference.state_dict().items()}
    assert max(max_abs_diff(trained, theirs).values()) <= 1e-9


def test_profile_all_on_one_gpu_measures_what_the_solver_needs_and_no_intra_all_reduce(tmp_path: Path) -> None:
    """A server of one GPU never all-reduces within itself, and NCCL refuses two ranks on one GPU: `jabas
    profile all` leaves the intra-node stage out instead of failing on it, and the solver plans from the rest."""
    config = _resnet_on_this_gpu(tmp_path, job="lbs = 32\n")
    profiled = CliRunner().invoke(
        app, ["profile", "all", "-c", str(config), "--lbs", "32", "--gbs-max", "32", "--json"]
    )
    assert profiled.exit_code == 0, profiled.output
    stages = [s["name"] for s in json.loads(profiled.stdout)["stages"]]
    assert stages == ["bucket", "mem gpu", "comp gpu"]
    solved = CliRunner().invoke(app, ["solve", "-c", str(config), "--gbs", "32", "--json"])
    assert solved.exit_code == 0, solved.output
