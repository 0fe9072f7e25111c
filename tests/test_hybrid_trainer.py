"""`[parallel]` layouts in the real trainer (engine/trainer.py) on gloo processes equal the single-process reference.

Each rank is a real :class:`~jabascli.engine.trainer.Trainer` in its own process (``mp.spawn``, or
`jabas run`'s trainers), training tiny GPT in float64 for 12 iterations over two epochs (each dropping
a remainder) with its layout built by :mod:`jabascli.engine.parallel.runner`: ``sharding = "full"``
over 2 ranks running unequal micro-batch counts (3 and 1), ``tp = 2`` (one replica running both
devices' micro-batches), ``pp = 2`` with stages of 3 and 1 blocks, clipped by the global norm. Every
parameter ends within 1e-9 of :func:`jabascli.engine.reference.reference_run`; validation's loss is the
reference model's. Also: a GBS and LBS change mid-epoch, a `jabas run` killed with SIGKILL and resumed
under another layout, an emulated memory budget that only a sharded Adam state fits, and what is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import TrainingPlan, load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.trainer import Trainer
from jabascli.errors import RuntimeFailure
from jabascli.net import free_port
from tests.engine_support import TRAINER_ENV, load, max_abs_diff
from tests.test_hybrid_exactness import write_config


def changed_plan(plan: TrainingPlan, change: dict[str, Any]) -> TrainingPlan:
    """``plan`` at LBS ``change["lbs"]``, server ``s<i>``'s ranks with GA ``change["ga"][i]``."""
    ranks = tuple(dataclasses.replace(r, ga=change["ga"][int(r.server[1:])]) for r in plan.ranks)
    return dataclasses.replace(plan, lbs=change["lbs"], ranks=ranks)


def _rank(rank: int, world: int, port: int, config: str, out: str, change: dict[str, Any]) -> None:
    """One trainer rank, in-process, so that it can switch to another plan after iteration ``change["at"]``
    (mid-epoch), as an adaptive decision would (tests/test_hybrid_adaptive.py lets the policy decide)."""
    torch.set_num_threads(1)
    loaded = load(Path(config))
    init_process_group(DistEnv(rank, world, rank, "127.0.0.1", port), torch.device("cpu"))
    trainer = None
    try:
        events: list[dict[str, Any]] = []
        options = TrainOptions(metrics=False)
        trainer = Trainer(loaded, load_plan(loaded), rank, torch.device("cpu"), options, events.append)

        def decide(
            step: int, plan: TrainingPlan, where: object, report: object, busy: object = None
        ) -> TrainingPlan | None:
            return changed_plan(plan, change) if step == change["at"] else None

        trainer.adaptive.after_step = decide  # type: ignore[method-assign]
        results = trainer.fit()
        assert trainer.layout_workers is not None
        torch.save(trainer.layout_workers.replica.full_state_dict(), Path(out) / f"rank{rank}.pt")  # a collective
        if rank == 0:
            summary = {"events": events, "steps": trainer.progress.step, "val_loss": [r.val_loss for r in results]}
            summary["history"] = trainer.progress.gbs_history
            (Path(out) / "result.json").write_text(json.dumps(summary))
    finally:
        trainer = None  # its process group users go first (as run_trainer does)
        gc.collect()
        dist.destroy_process_group()


def train_with_change(
    config: Path, world: int, out: Path, change: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model (every rank's part merged: pipeline stages hold different blocks) and rank 0's summary."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(world, free_port(), str(config), str(out), change), nprocs=world)
    whole: dict[str, torch.Tensor] = {}
    for r in range(world):
        whole.update(torch.load(out / f"rank{r}.pt", weights_only=True))
    return whole, json.loads((out / "result.json").read_text())


def validation_loss(model: torch.nn.Module, loaded: Any) -> float:
    from jabascli.engine.data import BatchLoader
    from jabascli.workload import workload_of

    workload = workload_of(loaded)
    val = workload.val_dataset()
    inputs, target = BatchLoader(val, torch.device("cpu"), workload.collate)(range(len(val)))
    model.eval()
    with torch.no_grad():
        return float(workload.loss(model(inputs), target))


def job(
    tmp_path: Path,
    optimizer: str,
    ga: list[int],
    devices: int,
    parallel: dict[str, Any],
    slowdown: float | None = None,
    **job_keys: Any,
) -> Path:
    """The hybrid exactness tests' job (6 iterations an epoch, 2 epochs), with more ``[job]`` keys, its servers
    emulated ``slowdown`` times slower if given."""
    path = write_config(tmp_path, "gpt", optimizer, ga, parallel, devices=devices)
    config = tomllib.loads(path.read_text())
    config["job"].update({k: v for k, v in job_keys.items() if v is not None})
    for server in config["cluster"]["servers"] if slowdown is not None else []:
        server["emulate"] = {"slowdown": slowdown, "memory_bytes": 10**9}
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


CLIP = 0.05
"""Small enough to clip every step of these runs (checked against the unclipped reference)."""

CASES = [
    pytest.param("adam", [2, 0], 1, {"sharding": "full"}, CLIP, id="sharding-full-2-ranks-unequal-clipped"),
    pytest.param(
        "sgd", [1], 2, {"pp": 2, "stages": [[0, 2], [3, 3]], "schedule": "1f1b"}, CLIP, id="pp-2-1f1b-clipped"
    ),
    pytest.param("adam", [1], 2, {"tp": 2}, CLIP, id="tp-2-clipped", marks=pytest.mark.slow),  # also resumed below
    # 2 replicas of tp = 2 on two servers, running 2 x 2 and 2 x 1 micro-batches: gradients summed across them
    pytest.param("sgd", [1, 0], 2, {"tp": 2}, CLIP, id="2-replicas-of-tp-2-clipped", marks=pytest.mark.slow),
    # FSDP2 x TP: the DP dimension of a TP-split weight's shard is a _StridedShard, a shard to the norm too
    pytest.param(
        "adam",
        [2, 0],
        2,
        {"tp": 2, "sharding": "full"},
        CLIP,
        id="2-replicas-of-tp-2-sharded-clipped",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("optimizer", "ga", "devices", "parallel", "clip"), CASES)
def test_trainer_runs_the_layout_and_equals_the_reference(
    tmp_path: Path, optimizer: str, ga: list[int], devices: int, parallel: dict[str, Any], clip: float | None
) -> None:
    loaded = load(job(tmp_path, optimizer, ga, devices, parallel, clip_grad_norm=clip))
    events: list[dict[str, Any]] = []
    result = run_local(loaded, TrainOptions(metrics=False), events.append, TRAINER_ENV)  # `jabas run`'s trainers
    assert result.done["step"] == 12
    trained = read_checkpoint(checkpoint_folder(loaded))["model"]  # the DCP checkpoint every rank wrote, whole
    start = next(e for e in events if e["event"] == "start")
    assert start["weight_sync"] == "sequential" and "[parallel] layout" in start["weight_sync_reason"]
    assert start["layout"].startswith(next(iter(parallel)))  # e.g. "sharding full", "tp 2", "pp 2 (blocks ..."
    # A replica (tp x pp consecutive ranks) runs the micro-batches of all its devices: GA + 1 each.
    size, per_rank = parallel.get("tp", 1) * parallel.get("pp", 1), [g + 1 for g in ga for _ in range(devices)]
    assert start["replicas"] == [sum(per_rank[i : i + size]) for i in range(0, len(per_rank), size)]

    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
    # Validation ran on every replica's share and counted each sample once.
    assert result.done["results"][-1]["val_loss"] == pytest.approx(validation_loss(reference, loaded), rel=1e-9)
    if clip is not None:
        loaded.config.job.clip_grad_norm = None
        unclipped, _ = reference_run(loaded, load_plan(loaded), steps=12)
        assert max(max_abs_diff(trained, unclipped.state_dict()).values()) > 1e-4, "the clip should matter"


CHANGES = [
    # 3 + 1 micro-batches of LBS 2 (GBS 8), then 2 + 2 of LBS 3 (GBS 12): equal counts, ZeRO-3 per micro-batch
    pytest.param([2, 0], 1, {"sharding": "full"}, {"at": 3, "lbs": 3, "ga": [1, 1]}, id="sharding-full"),
    # GPipe over stages of 1 and 3 blocks, two checkpointed, on an emulated 2x slower device (its blocks sleep):
    # 4 micro-batches of LBS 2, then 6 of LBS 1 (new schedules, new shapes)
    pytest.param(
        [1],
        2,
        {"pp": 2, "stages": [[0, 0], [1, 3]], "schedule": "gpipe", "checkpointing": [1, 2]},
        {"at": 3, "lbs": 1, "ga": [2], "slowdown": 2.0},
        id="pp-2-gpipe-checkpointing-emulated",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("ga", "devices", "parallel", "change"), CHANGES)
def test_a_gbs_change_mid_epoch_under_a_layout_equals_the_reference_with_the_same_history(
    tmp_path: Path, ga: list[int], devices: int, parallel: dict[str, Any], change: dict[str, Any]
) -> None:
    loaded = load(job(tmp_path, "adam", ga, devices, parallel, change.get("slowdown")))
    trained, result = train_with_change(loaded.path, len(ga) * devices, tmp_path, change)
    history = result["history"]
    assert [(h["step"], h["epoch"], h["lbs"]) for h in history][1] == (3, 0, change["lbs"]), history
    assert result["steps"] >= 9 and len(result["val_loss"]) == 2  # two epochs
    reference, _ = reference_run(loaded, load_plan(loaded), steps=result["steps"], schedule=history)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def with_keys(path: Path, section: str, keys: dict[str, Any]) -> Path:
    config = tomllib.loads(path.read_text())
    config.setdefault(section, {}).update(keys)
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


@pytest.mark.parametrize(
    ("parallel", "section", "keys", "words"),
    [
        ({"sharding": "full"}, "job", {"precision": "fp16"}, "job.precision: fp16 with a [parallel] layout"),
        ({"pp": 2}, "job", {"precision": "bf16"}, "job.precision: bf16 with parallel.pp > 1"),
        ({"tp": 3}, "job", {}, "parallel.tp: 3 does not divide block 0's attention.q (32 output features)"),
        ({"tp": 8}, "job", {}, "parallel.tp: 8 does not divide block 0's 4 attention heads (self_attention)"),
    ],
)
def test_what_a_layout_does_not_train_exactly_is_refused_in_one_line_naming_the_field(
    tmp_path: Path, parallel: dict[str, Any], section: str, keys: dict[str, Any], words: str
) -> None:
    """Before any process group (Trainer.__init__ calls it): `jabas train` exits 2 with this one line."""
    from jabascli.engine.parallel.runner import check_trainer_layout_inputs, trainer_layout
    from jabascli.errors import InputError
    from jabascli.workload import workload_of

    base = "vit" if parallel.get("tp") == 8 else "gpt"  # ViT tiny: width 64, MLP 128, 4 heads
    path = write_config(tmp_path, base, "adam", [0], parallel, devices=parallel.get("tp", 2))
    loaded = load(with_keys(path, section, keys))
    workload = workload_of(loaded)
    model = workload.build_model()
    layout = trainer_layout(loaded, workload, model)
    assert layout is not None
    with pytest.raises(InputError) as info:
        check_trainer_layout_inputs(loaded, layout, model, workload)
    assert len(info.value.lines()) == 1 and words in info.value.lines()[0]


BUDGET = 2_000_000
"""An emulated device's memory for tiny GPT in float64 with Adam (params + grads + Adam state ~1.8 MB): seen
2.7 MB peak per rank for plain IIDP, 1.4 MB with ``sharding = "full"`` over 2 ranks (what a rank holds)."""


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"sharding": "full"}, id="sharded-fits"),
        pytest.param(None, id="plain-out-of-memory", marks=pytest.mark.slow),
    ],
)
def test_adam_state_that_does_not_fit_an_emulated_device_trains_once_sharded(
    tmp_path: Path, parallel: dict[str, Any] | None
) -> None:
    path = write_config(tmp_path, "gpt", "adam", [0, 0], parallel or {})
    config = tomllib.loads(path.read_text())
    if parallel is None:
        del config["parallel"]
    for server in config["cluster"]["servers"]:
        server["emulate"] = {"memory_bytes": BUDGET}
    path.write_bytes(tomli_w.dumps(config).encode())
    loaded = load(path)
    if parallel is None:
        with pytest.raises(RuntimeFailure, match=r"out of memory on emulated device s\d \(cpu\), rank \d: peak"):
            run_local(loaded, TrainOptions(metrics=False, max_steps=2), None, TRAINER_ENV)
        return
    result = run_local(loaded, TrainOptions(metrics=False), None, TRAINER_ENV)
    assert result.done["step"] == 12  # to the end: two epochs


RESUMES = [
    # sharded over two servers' devices (3 + 1 micro-batches) -> one TP replica of one server's 2 devices (2 x 2)
    pytest.param(([2, 0], 1, {"sharding": "full"}), ([1], 2, {"tp": 2}), id="sharded-2-ranks-to-tp-2"),
    pytest.param(
        ([1], 2, {"pp": 2, "schedule": "1f1b"}), ([2, 0], 1, None), id="pp-2-to-plain", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("before", "after"), RESUMES)
def test_a_killed_run_resumes_under_another_layout_and_equals_the_reference(
    tmp_path: Path, before: tuple[list[int], int, dict[str, Any]], after: tuple[list[int], int, dict[str, Any] | None]
) -> None:
    """`jabas run`'s trainers (real processes) write DCP checkpoints every 2 iterations; rank 0 is killed with
    SIGKILL after the one of iteration 4; the job resumes, resharded, under a layout of the same GBS (8)."""
    loaded = load(job(tmp_path, "adam", *before))
    pids: list[int] = []

    def kill_after_step_4(event: dict[str, Any]) -> None:
        if event["event"] == "start":
            pids.append(event["pid"])
        elif event["event"] == "checkpoint" and event["step"] >= 4 and len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)
            pids.append(event["step"])

    with pytest.raises(RuntimeFailure, match="killed by signal 9"):
        run_local(loaded, TrainOptions(metrics=False, checkpoint_every=2), kill_after_step_4, TRAINER_ENV)
    saved = read_checkpoint(checkpoint_folder(loaded))  # a .dcp folder, read whole
    assert saved["progress"]["step"] >= 4

    ga, devices, parallel = after
    path = job(tmp_path, "adam", ga, devices, parallel or {})
    if parallel is None:  # plain IIDP
        config = tomllib.loads(path.read_text())
        del config["parallel"]
        path.write_bytes(tomli_w.dumps(config).encode())
    events: list[dict[str, Any]] = []
    run_local(load(path), TrainOptions(metrics=False, resume=checkpoint_folder(loaded)), events.append, TRAINER_ENV)
    start = next(e for e in events if e["event"] == "start")
    assert (start["gbs"], start["step"]) == (8, saved["progress"]["step"])

    final = read_checkpoint(checkpoint_folder(loaded))
    assert final["progress"]["step"] == 12
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
