"""Adaptive GBS under `[parallel]` layouts: the measurement and every iteration equal the plain computation.

`jabas run`'s trainers (real gloo processes) train tiny GPT in float64 with `[batching] metric` other than
fixed, measuring every 2 iterations, under ``sharding = "full"`` on 2 ranks running unequal micro-batch
counts, ``tp = 2``, ``pp = 2``, per-block ``layers`` (sharded and whole blocks, one checkpointed), and (slow)
``tp = 2`` sharded over 2 replicas and ``pp = 2`` with each stage sharded over 2 replicas. The first-half
gradient is read inside the layout (:mod:`jabascli.adaptive.layout_measure`); the policy changes the GBS at
least once (goodput: replanned by the solver from profiles the test writes; the other metrics by the
fallback replanner). Checked: every parameter equals the single-process reference following the recorded
GBS history within 1e-9, and each measurement's similarity and noise estimates equal what the reference
measures plainly from the first ``floor(W / 2)`` workers' whole gradients within 1e-9; for one case also
what the same job measures as plain IIDP (no `[parallel]`).
"""

from __future__ import annotations

import os
import signal
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from jabascli.adaptive.estimators import HalfGradients
from jabascli.config.loader import BUCKET_DIRNAME, COMMUNICATION_DIRNAME, COMPUTATION_DIRNAME, MEMORY_DIRNAME
from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import RuntimeFailure
from jabascli.profiles import BucketProfile, CommMeta, CommProfile, CompProfile, MemoryProfile, ring_allreduce_ideal_ms
from jabascli.profiles.formats import write_bucket_profile, write_comm_profile, write_comp_profile, write_memory_profile
from tests.engine_support import TRAINER_ENV, load, max_abs_diff
from tests.test_hybrid_exactness import WORKLOAD
from tests.test_hybrid_trainer import job, with_keys

INTERVAL = 2


def measurements(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events if e["event"] == "adjustment"}


def assert_same_measurements(got: dict[int, dict[str, Any]], plain: dict[int, HalfGradients]) -> None:
    """Every adjustment's similarity and noise estimates are ``plain``'s (the reference's) of its step."""
    assert got and set(got) <= set(plain), (sorted(got), sorted(plain))
    for step, e in got.items():
        grad_sq, trace = plain[step].noise()
        assert e["similarity"] == pytest.approx(plain[step].similarity(), rel=1e-9, abs=1e-12), step
        assert e["grad_sq"] == pytest.approx(grad_sq, rel=1e-9), step
        assert e["trace"] == pytest.approx(trace, rel=1e-9), step


def without_parallel(path: Path) -> Path:
    config = tomllib.loads(path.read_text())
    del config["parallel"]
    folder = path.parent / "plain"
    config["storage"] = {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")}
    plain = path.with_name("plain.toml")
    plain.write_bytes(tomli_w.dumps(config).encode())
    return plain


def write_profiles(folder: Path, servers: int) -> Path:
    """Profiles of the servers ``s0 ...`` (goodput's throughput is the solver's prediction from them): LBS 2
    only, one VSW, an update as long as 5 backwards, so that larger GBS (more GA) are faster per sample."""
    name = Path(WORKLOAD).stem
    for server in (f"s{i}" for i in range(servers)):
        memory = MemoryProfile(gpu_type="cpu", total_memory=2**30, lbs=2, max_num_models=1)
        write_memory_profile(folder / MEMORY_DIRNAME, server, memory)
        times = {"total_time": 0.0, "data_time": 0.1, "fwd_time": 4.0, "bwd_time": 6.0, "update_time": 30.0}
        computation = CompProfile(model=name, gpu_type="cpu", lbs=2, num_models=1, copy_time=0.0, **times)
        write_comp_profile(folder / COMPUTATION_DIRNAME, server, computation)
    write_bucket_profile(folder / BUCKET_DIRNAME, BucketProfile(model=name, bucket_size_distribution=[1.0]))
    ideal = [ring_allreduce_ideal_ms(size * 2**20, 1e9, 2) for size in (1, 4, 16)]
    for kind in ("intra", "inter"):
        meta = CommMeta(bandwidth=1e9, world_size=2)
        write_comm_profile(
            folder / COMMUNICATION_DIRNAME, CommProfile(kind=kind, ideal_ms=ideal, measured_ms=ideal, meta=meta)
        )
    return folder


SHRINK = {"metric": "similarity", "similarity_target": 0.01, "gbs_min": 4}
"""Tiny GPT's halves first agree far more than 0.01: the first measurement halves the GBS (8 -> 4); later ones,
as the halves disagree, grow it again (seen: 4 -> 6 -> 8 -> 12 -> 18)."""
GOODPUT = {"metric": "goodput", "gbs_min": 4, "gbs_max": 16}
"""With :func:`write_profiles`' throughput, rising with the GBS, the measurements grow it (seen: 8 -> 12 -> 16)."""
GROW = {"metric": "noise_scale", "gbs_max": 16}
"""Its noise scale is above these GBS: the measurements grow the GBS (seen: 8 -> 12 -> 16)."""

CASES = [
    # 1 + 3 micro-batches of LBS 2 (rank 0's all in the first half), then the solver's 3 + 3, 4 + 4 (ZeRO-3 proper)
    pytest.param("adam", [0, 2], 1, {"sharding": "full"}, GOODPUT, 2, id="sharding-full-2-ranks-unequal-goodput"),
    pytest.param("sgd", [1], 2, {"tp": 2}, GOODPUT, 1, id="tp-2-goodput"),
    pytest.param(
        "adam", [1], 2, {"pp": 2, "stages": [[0, 2], [3, 3]], "schedule": "1f1b"}, SHRINK, 2, id="pp-2-1f1b-similarity"
    ),
    # per-block layers: blocks 0-1 whole (all-reduced over the 2 ranks), 2-3 sharded, block 1 checkpointed
    pytest.param(
        "adam",
        [1, 0],
        1,
        {"sharding": "full", "checkpointing": [1], "layers": [{"blocks": [0, 1], "sharding": "none"}]},
        GROW,
        1,
        id="layers-sharded-and-whole-checkpointed",
    ),
    # 2 replicas of tp = 2 (2 servers x 2 devices, 3 + 3 and 1 + 1 micro-batches), sharded over them: FSDP2 x TP
    pytest.param(
        "adam",
        [2, 0],
        2,
        {"tp": 2, "sharding": "full"},
        SHRINK,
        1,
        id="tp-2-x-sharding-4-ranks",
        marks=pytest.mark.slow,
    ),
    # 2 replicas of 2 stages, each stage sharded over its 2 DP ranks, running 2 x 1 and 2 x 2 micro-batches
    pytest.param(
        "sgd", [0, 1], 2, {"pp": 2, "sharding": "full"}, SHRINK, 1, id="pp-2-sharded-4-ranks", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("optimizer", "ga", "devices", "parallel", "batching", "epochs"), CASES)
def test_adaptive_gbs_under_a_layout_measures_and_trains_as_plain_iidp(
    tmp_path: Path,
    optimizer: str,
    ga: list[int],
    devices: int,
    parallel: dict[str, Any],
    batching: dict[str, Any],
    epochs: int,
) -> None:
    keys = {"adjust_interval": INTERVAL, "adjust_rate": 0.5, "lr_scaling": "linear", **batching}
    path = with_keys(job(tmp_path, optimizer, ga, devices, parallel, epochs=epochs), "batching", keys)
    if batching["metric"] == "goodput":
        path = with_keys(path, "profiles", {"dir": str(write_profiles(tmp_path / "profiles", len(ga)))})
    loaded = load(path)
    events: list[dict[str, Any]] = []
    result = run_local(loaded, TrainOptions(metrics=False), events.append, TRAINER_ENV)
    saved = read_checkpoint(checkpoint_folder(loaded))
    history = saved["progress"]["gbs_history"]
    changes = [e for e in events if e["event"] == "adjustment" and e["changed"]]
    assert changes, "the policy should change the GBS"
    assert [(e["old_gbs"], e["new_gbs"]) for e in changes] == [(a["gbs"], b["gbs"]) for a, b in pairwise(history)]

    steps = result.done["step"]
    halves: dict[int, HalfGradients] = {}
    reference, _ = reference_run(loaded, load_plan(loaded), steps, history, halves_every=INTERVAL, halves=halves)
    diffs = max_abs_diff(saved["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
    measured = measurements(events)
    assert len(measured) == steps // INTERVAL
    assert_same_measurements(measured, halves)

    if parallel == {"sharding": "full"}:  # the same job as plain IIDP: the same decisions, the same numbers
        plain_events: list[dict[str, Any]] = []
        plain = load(without_parallel(loaded.path))
        run_local(plain, TrainOptions(metrics=False), plain_events.append, TRAINER_ENV)
        plain_measured = measurements(plain_events)
        assert sorted(plain_measured) == sorted(measured)
        for step, e in measured.items():
            for key in ("similarity", "grad_sq", "trace", "new_gbs"):
                assert e[key] == pytest.approx(plain_measured[step][key], rel=1e-9, abs=1e-12), (step, key)


@pytest.mark.slow
def test_a_run_killed_after_a_gbs_change_resumes_under_another_layout_at_that_gbs_and_measures_at_once(
    tmp_path: Path,
) -> None:
    """`tp = 2` trainers change the GBS (8 -> 4 after iteration 2), checkpoint after iteration 5 and are
    killed (SIGKILL); the job resumes sharded over 2 ranks at GBS 4 and LR factor 0.5. Its first iteration
    is a measurement iteration on FSDP2 units that have not gathered yet (the hooks go on at their first
    forward). Parameters and measurements equal the reference's following the whole history."""
    keys = {"adjust_interval": INTERVAL, "adjust_rate": 0.5, "lr_scaling": "linear", **SHRINK}
    loaded = load(with_keys(job(tmp_path, "adam", [1], 2, {"tp": 2}, epochs=1), "batching", keys))
    pids: list[int] = []
    before: list[dict[str, Any]] = []

    def kill_after_step_5(event: dict[str, Any]) -> None:
        before.append(event)
        if event["event"] == "start":
            pids.append(event["pid"])
        elif event["event"] == "checkpoint" and event["step"] == 5 and len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)
            pids.append(event["step"])

    with pytest.raises(RuntimeFailure, match="killed by signal 9"):
        run_local(loaded, TrainOptions(metrics=False, checkpoint_every=5), kill_after_step_5, TRAINER_ENV)
    saved = read_checkpoint(checkpoint_folder(loaded))
    assert saved["progress"]["step"] == 5 and saved["adaptive"]["plan"]["gbs"] == 4
    assert saved["adaptive"]["lr"]["factor"] == 0.5

    path = with_keys(job(tmp_path, "adam", [0, 2], 1, {"sharding": "full"}, epochs=1), "batching", keys)
    after: list[dict[str, Any]] = []
    run_local(load(path), TrainOptions(metrics=False, resume=checkpoint_folder(loaded)), after.append, TRAINER_ENV)
    start = next(e for e in after if e["event"] == "start")
    assert (start["gbs"], start["step"], start["layout"]) == (4, 5, "sharding full")
    final = read_checkpoint(checkpoint_folder(loaded))
    history = final["progress"]["gbs_history"]
    assert history[: len(saved["progress"]["gbs_history"])] == saved["progress"]["gbs_history"]

    halves: dict[int, HalfGradients] = {}
    steps = final["progress"]["step"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps, history, halves_every=INTERVAL, halves=halves)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
    measured = {**measurements(before), **measurements(after)}
    assert 6 in measurements(after) and len(measured) == steps // INTERVAL
    assert_same_measurements(measured, halves)
