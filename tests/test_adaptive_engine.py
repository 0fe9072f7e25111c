"""Adaptive GBS in real gloo trainers: plans change in place, and every iteration is still exact.

2 and 3 trainer ranks (real gloo processes) with uneven (VSW, GA) and odd
worker counts (7 and 11) measure the gradient similarity every 2 iterations; a
similarity target far below what this learnable tiny workload shows makes the
first adjustments shrink the GBS (by up to half) down to ``gbs_min``, which only
an LBS change reaches (later ones may grow it again). Checked: at least two
plan changes in the first epoch, one of them of LBS; every replica of every
rank ends with identical parameters and buffers (the ranks applied the same
plans); they equal (float64) the single-process reference following the
recorded GBS/LBS schedule; the samples each epoch used, as recorded by the
trainers' datasets, are distinct and number exactly ``N`` minus the remainder.
Then a job killed with SIGKILL after GBS changes resumes at its GBS and LR."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jabascli.adaptive.estimators import HalfGradients
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.trainer import Trainer
from jabascli.errors import RuntimeFailure
from jabascli.net import free_port
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

SAMPLES = 150

CASES = [
    # ranks (VSW, GA), VSW strategy, weight sync, gbs_min: 28 -> 12 -> 6 (LBS 3); 44 -> 20 -> 9 (LBS 3)
    pytest.param([(3, 1), (1, 0)], "sequential", "sequential", 6, id="2-ranks-7-workers"),
    pytest.param([(2, 0), (1, 2), (3, 1)], "streams", "overlap", 9, id="3-ranks-11-workers-streams"),
]


def epochs_used(folder: Path, ranks: int) -> list[list[int]]:
    """Per epoch, the training samples all ranks loaded (validation lines separate the epochs)."""
    per_epoch: list[list[int]] = []
    for rank in range(ranks):
        epoch, previous = 0, "t"
        for line in (folder / f"record-{rank}.txt").read_text().splitlines():
            if line == "v" and previous != "v":
                epoch += 1
            elif line != "v":
                while len(per_epoch) <= epoch:
                    per_epoch.append([])
                per_epoch[epoch].append(int(line.split()[1]))
            previous = line[0]
    return per_epoch


def _trainer_rank(rank: int, world: int, port: int, config: str, out: str) -> None:
    """One rank, in-process (so that every replica of every rank can be gathered at the end)."""
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)  # the tiny workload's sample record is per rank
    loaded = load(Path(config))
    init_process_group(DistEnv(rank, world, rank, "127.0.0.1", port), torch.device("cpu"))
    try:
        events: list[dict[str, Any]] = []
        options = TrainOptions(bucket_cap_mb=0.0005, metrics=False)
        trainer = Trainer(loaded, load_plan(loaded), rank, torch.device("cpu"), options, events.append)
        trainer.fit()
        states = [r.state_dict() for r in trainer.vsw.replicas]
        gathered: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, states)
        if rank == 0:
            torch.save([s for rank_states in gathered for s in rank_states], Path(out) / "states.pt")
            result = {"history": trainer.progress.gbs_history, "steps": trainer.progress.step, "events": events}
            (Path(out) / "result.json").write_text(json.dumps(result))
    finally:
        # Free DDP (it holds the process group) before the group goes, as run_trainer does: left to the
        # interpreter, gloo's threads may be torn down out of order and abort the process (seen in CI).
        trainer = None
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize(("ranks", "vsw", "sync", "gbs_min"), CASES)
def test_plans_change_in_place_and_every_iteration_equals_the_reference(
    tmp_path: Path, ranks: list[tuple[int, int]], vsw: str, sync: str, gbs_min: int
) -> None:
    record = tmp_path / "record"
    record.mkdir()
    options = {"samples": SAMPLES, "learnable": True, "dropout": 0.0, "record": str(record)}
    batching = {"metric": "similarity", "similarity_target": 0.01, "adjust_rate": 0.5, "adjust_interval": 2}
    batching["lr_scaling"] = "linear"
    config = write_job(
        tmp_path,
        ranks,
        lbs=4,
        options=options,
        weight_sync=sync,
        vsw_strategy=vsw,
        batching={**batching, "gbs_min": gbs_min},
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_trainer_rank, args=(len(ranks), free_port(), str(config), str(tmp_path)), nprocs=len(ranks))
    result = json.loads((tmp_path / "result.json").read_text())
    states = torch.load(tmp_path / "states.pt", weights_only=True)

    history = result["history"]
    first_epoch = [h for h in history if h["epoch"] == 0]
    assert len(first_epoch) >= 3, history  # the start and at least two changes within the first epoch
    assert first_epoch[2]["gbs"] == gbs_min and first_epoch[2]["lbs"] == 3  # shrunk twice, the second time LBS
    assert all(h["lr_factor"] == h["gbs"] / history[0]["gbs"] for h in history)  # linear LR scaling
    changes = [e for e in result["events"] if e["event"] == "adjustment" and e["changed"]]
    assert [(e["old_gbs"], e["new_gbs"]) for e in changes] == [(a["gbs"], b["gbs"]) for a, b in pairwise(history)]
    assert all(e["similarity"] > 0.01 for e in changes[:2])

    # Every replica of every rank holds the same parameters and buffers: all ranks applied the same plans.
    for other in states[1:]:
        assert all(torch.equal(value, other[name]) for name, value in states[0].items())
    halves: dict[int, HalfGradients] = {}
    loaded = load(config)
    reference, _ = reference_run(loaded, load_plan(loaded), result["steps"], history, halves_every=2, halves=halves)
    diffs = max_abs_diff(states[0], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}  # issue: 1e-5

    # What the ranks measured from their first-half buffers is what one process measures plainly.
    measured = [e for e in result["events"] if e["event"] == "adjustment"]
    assert len(measured) == result["steps"] // 2
    for e in measured:
        plain = halves[e["step"]]
        assert e["similarity"] == pytest.approx(plain.similarity(), rel=1e-9, abs=1e-12), e["step"]
        grad_sq, trace = plain.noise()
        assert (e["grad_sq"], e["trace"]) == (pytest.approx(grad_sq, rel=1e-9), pytest.approx(trace, rel=1e-9))

    used = epochs_used(record, len(ranks))
    assert len(used) == 2
    for samples in used:
        assert max(Counter(samples).values()) == 1  # no sample twice in an epoch
        assert 0 <= SAMPLES - len(samples) < gbs_min  # all but the remainder at the epoch's final GBS


def test_a_job_killed_after_a_gbs_change_resumes_at_that_gbs_and_lr_and_continues_exactly(tmp_path: Path) -> None:
    servers = [
        {"name": "fast", "device_type": "cpu", "devices": 1, "vsw": 3, "ga": 1},
        {"name": "slow", "device_type": "cpu", "devices": 1, "emulate": {"slowdown": 40.0, "memory_bytes": 10**9}},
    ]
    batching = {"metric": "similarity", "similarity_target": 0.01, "adjust_rate": 0.5, "adjust_interval": 2}
    config = write_job(
        tmp_path,
        [(3, 1), (1, 0)],
        options={"samples": SAMPLES, "learnable": True},
        servers=servers,
        batching={**batching, "gbs_min": 6, "lr_scaling": "sqrt"},
        epochs=1,
    )
    loaded = load(config)
    pids: list[int] = []

    def kill_after_the_second_change(event: dict[str, Any]) -> None:
        if event["event"] == "start":
            pids.append(event["pid"])
        elif event["event"] == "checkpoint" and event["step"] >= 5 and len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)
            pids.append(event["step"])

    with pytest.raises(RuntimeFailure, match="killed by signal 9"):
        run_local(
            loaded, TrainOptions(checkpoint_every=5, bucket_cap_mb=0.0005), kill_after_the_second_change, TRAINER_ENV
        )
    saved = checkpoint_of(loaded)
    gbs, lbs = saved["adaptive"]["plan"]["gbs"], saved["adaptive"]["plan"]["lbs"]
    assert saved["progress"]["step"] >= 5 and gbs < 28  # shrunk (28 -> 12 at step 2, maybe more at step 4)
    factor = saved["adaptive"]["lr"]["factor"]
    assert factor == pytest.approx(math.sqrt(gbs / 28))

    events: list[dict[str, Any]] = []
    run_local(loaded, TrainOptions(resume=checkpoint_folder(loaded), bucket_cap_mb=0.0005), events.append, TRAINER_ENV)
    start = next(e for e in events if e["event"] == "start")
    assert (start["gbs"], start["lbs"], start["step"]) == (gbs, lbs, saved["progress"]["step"])

    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    assert history[: len(saved["progress"]["gbs_history"])] == saved["progress"]["gbs_history"]
    assert all(h["lr_factor"] == pytest.approx(math.sqrt(h["gbs"] / 28)) for h in history)  # the factor resumed too
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs
