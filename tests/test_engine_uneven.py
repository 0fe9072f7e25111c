"""An uneven plan (ranks with their own LBS) is synchronous SGD at GBS: real gloo trainers, float64.

Two references, each written apart from the engine: the single-process reference fed the plan's
micro-batches (BatchNorm and dropout see the same micro-batches), and, for a model without
batch-dependent layers, plain full-batch SGD on the GBS samples of each iteration computed here,
which does not know how the batch was split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.sampler import IIDPSampler, mix64
from jabascli.errors import InputError
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

TINY_BUCKETS_MB = 0.0005

# (vsw, ga, lbs) per rank: rank 0 two micro-batches of 7, rank 1 one of 5, rank 2 three of 3.
THREE = [(1, 1, 7), (1, 0, 5), (3, 0, 3)]
TWO = [(1, 0, 11), (1, 0, 6)]

LINEAR = """
import torch
from torch import nn

def build_model(options):
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()

def train_dataset(options):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(int(options.get("samples", 120)), 6, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g))

def loss(output, target):
    return nn.functional.cross_entropy(output, target)

def optimizer(params, options):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)

def synthetic_batch(batch_size, options):
    return torch.randn(batch_size, 6, dtype=torch.float64), torch.randint(0, 3, (batch_size,))
"""


def _uneven_job(folder: Path, ranks: list[tuple[int, int, int]], *, weight_sync: str, **kwargs: Any) -> Path:
    """A job whose plan file gives every rank its own LBS; returns the config."""
    config = write_job(folder, [(v, g) for v, g, _ in ranks], lbs=4, weight_sync=weight_sync, **kwargs)
    assignments = [
        {"server": f"s{i}", "device_type": "cpu", "gpus": 1, "vsw": v, "ga": g, "lbs": lbs}
        for i, (v, g, lbs) in enumerate(ranks)
    ]
    gbs = sum(v * (g + 1) * lbs for v, g, lbs in ranks)
    plan = {"gbs": gbs, "lbs": min(lbs for *_, lbs in ranks), "weight_sync": weight_sync, "assignments": assignments}
    (folder / "uneven-plan.json").write_text(json.dumps(plan))
    text = config.read_text().replace("[job]\n", f'[job]\nplan = "{folder / "uneven-plan.json"}"\n', 1)
    config.write_text(text)
    return config


def _train(config: Path) -> list[dict]:
    events: list[dict] = []
    result = run_local(
        load(config), TrainOptions(bucket_cap_mb=TINY_BUCKETS_MB, metrics=False), events.append, TRAINER_ENV
    )
    assert result.done["step"] > 0
    return events


def test_the_sampler_deals_every_sample_of_an_iteration_once_in_chunks_of_each_ranks_lbs(tmp_path: Path) -> None:
    plan = load_plan(load(_uneven_job(tmp_path, THREE, weight_sync="sequential")))
    assert plan.gbs == 7 * 2 + 5 + 3 * 3 and plan.uneven
    sampler = IIDPSampler(100, 7)
    perm = sampler.permutation(0)
    iterations = [list(sampler.rank_iterations(0, 0, plan, r)) for r in range(3)]
    assert {len(its) for its in iterations} == {100 // plan.gbs}
    for i in range(100 // plan.gbs):
        dealt = [mb for r in range(3) for mb in iterations[r][i].micro_batches]
        assert [len(mb.indices) for mb in dealt] == [7, 7, 5, 3, 3, 3]
        assert [mb.worker for mb in dealt] == list(range(6))
        samples = [s for mb in dealt for s in mb.indices]
        assert samples == perm[i * plan.gbs : (i + 1) * plan.gbs]  # in order: each once
        assert all(mb.seed == mix64(7, 0, mb.position) for mb in dealt)  # seeds follow the samples
    whole = list(sampler.global_iterations(0, 0, plan))[1]
    assert [mb.indices for mb in whole.micro_batches] == [
        mb.indices for r in range(3) for mb in iterations[r][1].micro_batches
    ]


@pytest.mark.parametrize(
    ("sync", "vsw"),
    [
        pytest.param("sequential", "sequential", id="sequential"),
        pytest.param("overlap", "streams", id="overlap-streams"),
    ],
)
def test_an_uneven_plan_equals_the_reference_fed_its_micro_batches(tmp_path: Path, sync: str, vsw: str) -> None:
    gbs = 7 * 2 + 5 + 3 * 3
    options = {"dtype": "float64", "samples": 6 * gbs + 5, "optimizer": "adam"}
    config = _uneven_job(tmp_path, THREE, weight_sync=sync, vsw_strategy=vsw, options=options)
    events = _train(config)
    start = next(e for e in events if e["event"] == "start")
    assert (start["gbs"], start["weight_sync"]) == (gbs, sync)
    loaded = load(config)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(checkpoint_of(loaded)["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs  # float64; running statistics included


def test_without_batch_statistics_an_uneven_plan_is_plain_sgd_on_the_gbs_samples(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(LINEAR)  # write_job keeps a workload already there
    samples, steps = 120, 6
    config = _uneven_job(tmp_path, TWO, weight_sync="overlap", options={"samples": samples}, epochs=1)
    _train(config)
    gbs = 11 + 6

    torch.manual_seed(7)  # the job's seed: the model is built after it, as the trainers build it
    namespace: dict[str, Any] = {}
    exec(compile(LINEAR, "linear", "exec"), namespace)
    model = namespace["build_model"]({})
    optimizer = namespace["optimizer"](model.parameters(), {})
    x, y = namespace["train_dataset"]({"samples": samples}).tensors
    perm = IIDPSampler(samples, 7).permutation(0)
    for step in range(samples // gbs):
        idx = perm[step * gbs : (step + 1) * gbs]
        optimizer.zero_grad()
        namespace["loss"](model(x[idx]), y[idx]).backward()  # the mean over the GBS samples, in one batch
        optimizer.step()
    assert steps <= samples // gbs
    diffs = max_abs_diff(checkpoint_of(load(config))["model"], model.state_dict())
    assert max(diffs.values()) <= 1e-12, diffs


def test_an_uneven_plan_is_refused_for_an_adaptive_job_naming_the_plan_file(tmp_path: Path) -> None:
    batching = {"metric": "similarity", "similarity_target": 0.01}
    config = _uneven_job(tmp_path, TWO, weight_sync="sequential", batching=batching)
    with pytest.raises(InputError) as err:
        load_plan(load(config))
    problem = err.value.problems[0]
    assert str(problem.file).endswith("uneven-plan.json") and "fixed GBS" in problem.message


def test_a_run_resumed_from_an_uneven_plan_under_an_even_one_equals_one_fed_both_plans(tmp_path: Path) -> None:
    """The position in the epoch is all a checkpoint needs: resumed under another split, no sample is repeated
    or skipped, and the reference fed the uneven micro-batches, then the even ones, is met."""
    gbs = 7 * 2 + 5 + 3 * 3  # 28: the even plan below runs 7 workers of LBS 4
    options = {"dtype": "float64", "samples": 6 * gbs + 5}
    first = _uneven_job(tmp_path / "a", THREE, weight_sync="overlap", options=options)
    run_local(load(first), TrainOptions(max_steps=4, bucket_cap_mb=TINY_BUCKETS_MB, metrics=False), None, TRAINER_ENV)
    uneven_plan = load_plan(load(first))

    second = write_job(tmp_path / "b", [(3, 0), (2, 1)], lbs=4, options=options)
    resumed = load(second)
    folder = checkpoint_folder(load(first))
    run_local(resumed, TrainOptions(resume=folder, metrics=False), None, TRAINER_ENV)
    final = checkpoint_of(resumed)
    history = final["progress"]["gbs_history"]
    assert final["progress"]["step"] == 12 and history[0]["plan"] == uneven_plan.describe()
    assert history[0]["sizes"] == [7, 7, 5, 3, 3, 3] and "sizes" not in history[1]  # what a reference is fed

    schedule = [
        {"step": 0, "gbs": gbs, "lbs": 3, "sizes": uneven_plan.micro_batch_sizes(), "lr_factor": 1.0},
        {"step": 4, "gbs": gbs, "lbs": 4, "lr_factor": 1.0},
    ]
    reference, _ = reference_run(resumed, load_plan(resumed), steps=12, schedule=schedule)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs
