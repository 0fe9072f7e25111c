"""Per-bucket optimizer application equals one full step; the `recommend` rule."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from jabascli.engine.bucket_undo import UndoLog
from jabascli.engine.weight_sync import BucketOptimizer, bucket_sizes, recommend_weight_sync, supports_overlap
from jabascli.profiler.bucket import ddp_bucket_sizes
from jabascli.workload import load_workload


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3)).double()


OPTIMIZERS = {
    "sgd-momentum-wd-groups": lambda m: torch.optim.SGD(
        [{"params": list(m.parameters())[:2], "lr": 0.05}, {"params": list(m.parameters())[2:]}],
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-3,
        nesterov=True,
    ),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=1e-3),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_stepping_bucket_by_bucket_equals_one_full_step(name: str) -> None:
    full, buckets = model(), model()
    opt_full, opt_buckets = OPTIMIZERS[name](full), OPTIMIZERS[name](buckets)
    sched_full = torch.optim.lr_scheduler.StepLR(opt_full, 2, 0.5)
    sched_buckets = torch.optim.lr_scheduler.StepLR(opt_buckets, 2, 0.5)
    per_bucket = BucketOptimizer(opt_buckets)
    rng = random.Random(1)
    for _ in range(5):
        for a, b in zip(full.parameters(), buckets.parameters(), strict=True):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt_full.step()
        params = list(buckets.parameters())
        rng.shuffle(params)
        cuts = sorted(rng.sample(range(1, len(params)), 2))
        for bucket in (params[: cuts[0]], params[cuts[0] : cuts[1]], params[cuts[1] :]):
            per_bucket.step(bucket)
        sched_full.step()
        sched_buckets.step()
    for a, b in zip(full.parameters(), buckets.parameters(), strict=True):
        assert torch.equal(a, b)
    state_full, state_buckets = opt_full.state_dict(), opt_buckets.state_dict()
    assert state_full["param_groups"] == state_buckets["param_groups"]
    assert state_full["state"].keys() == state_buckets["state"].keys()  # (filled in another order)
    for key, values in state_full["state"].items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_buckets["state"][key][name]))
    restored = [p for g in opt_buckets.param_groups for p in g["params"]]  # the groups are whole again
    assert [id(p) for p in restored] == [id(p) for p in buckets.parameters()]


def _state(optimizer: torch.optim.Optimizer) -> dict:
    return {
        k: {n: torch.as_tensor(v).clone() for n, v in values.items()}
        for k, values in optimizer.state_dict()["state"].items()
    }


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("first", [True, False])
def test_an_interrupted_iteration_is_taken_back_whole_and_redone_exactly(name: str, first: bool) -> None:
    """Two of three buckets updated when a peer is lost: putting them back leaves the parameters and optimizer
    state of the last completed iteration bit for bit (``first``: the optimizer's very first step, whose state it
    creates), a bucket whose all-reduce finishes late updates nothing, and redoing the iteration equals a run
    that was never interrupted."""
    torch.manual_seed(2)
    grads = [[torch.randn_like(p) for p in model().parameters()] for _ in range(2)]
    kept, redone = model(), model()
    opt_kept, opt_redone = OPTIMIZERS[name](kept), OPTIMIZERS[name](redone)
    undo = UndoLog()
    per_bucket = BucketOptimizer(opt_redone, undo)
    params = list(redone.parameters())
    buckets = (params[:2], params[2:4], params[4:])
    if not first:  # one completed iteration on each
        for m in (kept, redone):
            for p, g in zip(m.parameters(), grads[0], strict=True):
                p.grad = g.clone()
        opt_kept.step()
        undo.begin()
        for bucket in buckets:
            per_bucket.step(bucket)
    before = ([p.clone() for p in params], _state(opt_redone))

    undo.begin()
    for p, g in zip(params, grads[1], strict=True):
        p.grad = g.clone()
    per_bucket.step(buckets[0])
    per_bucket.step(buckets[1])
    assert not torch.equal(params[0], before[0][0])  # updated
    undo.take_back(opt_redone.state)
    assert all(torch.equal(p, b) for p, b in zip(params, before[0], strict=True))
    assert _state(opt_redone).keys() == before[1].keys()
    for key, values in before[1].items():
        assert all(torch.equal(_state(opt_redone)[key][n], v) for n, v in values.items())
    applied = per_bucket.applied
    per_bucket.step(buckets[2])  # its all-reduce finished after the failure was seen: nothing changes
    assert per_bucket.applied == applied and all(torch.equal(p, b) for p, b in zip(params, before[0], strict=True))

    # Redone by the next trainer (a new bucket optimizer over the same state), it equals the uninterrupted step.
    again = BucketOptimizer(opt_redone, UndoLog())
    for bucket in buckets:
        again.step(bucket)
    for p, g in zip(kept.parameters(), grads[1], strict=True):
        p.grad = g.clone()
    opt_kept.step()
    assert all(torch.equal(a, b) for a, b in zip(kept.parameters(), params, strict=True))


def test_only_optimizers_that_update_each_parameter_alone_can_overlap() -> None:
    m = model()
    assert supports_overlap(torch.optim.SGD(m.parameters(), lr=0.1))
    assert not supports_overlap(torch.optim.LBFGS(m.parameters()))

    class Custom(torch.optim.SGD):
        pass

    assert not supports_overlap(Custom(m.parameters(), lr=0.1))
    with pytest.raises(ValueError):
        BucketOptimizer(torch.optim.LBFGS(m.parameters()))


def test_recommend_overlaps_only_when_there_is_something_to_hide() -> None:
    sgd = torch.optim.SGD(model().parameters(), lr=0.1)
    assert recommend_weight_sync([7.81, 30.04, 25.04, 25.25, 9.2], 8, sgd).method == "overlap"
    assert recommend_weight_sync([0.1], 8, sgd).method == "sequential"
    assert recommend_weight_sync([10.0, 10.0], 1, sgd).method == "sequential"
    lbfgs = torch.optim.LBFGS(model().parameters())
    assert recommend_weight_sync([10.0, 10.0], 8, lbfgs).method == "sequential"


def test_bucket_sizes_pack_gradients_back_to_front_up_to_the_cap() -> None:
    m = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 1024))  # 1 MiB + 4 MiB of float32 weights
    sizes = bucket_sizes(m, cap_mb=2)
    assert sum(sizes) == sum(p.numel() * 4 for p in m.parameters())
    assert len(sizes) == 2 and sizes[0] == (1024 * 1024 + 1024) * 4
    assert len(bucket_sizes(m, cap_mb=25)) == 1


def test_default_buckets_are_the_ones_ddp_and_the_bucket_profiler_form() -> None:
    # No cap given: DDP's default, a first bucket of 1 MiB, then 25 MiB; the trainer builds DDP the same way.
    m = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 1024))
    sizes = bucket_sizes(m)
    assert sizes == [(1024 * 1024 + 1024) * 4, (256 * 1024 + 1024) * 4]
    workload = load_workload("resnet", {"variant": "tiny"})
    profiled, _ = ddp_bucket_sizes(workload, None)
    assert [s / 2**20 for s in bucket_sizes(workload.build_model())] == pytest.approx(profiled)
