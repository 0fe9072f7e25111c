"""BatchNorm and other buffers: exact running statistics, identical on every replica and rank."""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from jabascli.engine.buffers import BufferSync
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.trainer import Trainer
from jabascli.errors import InputError
from jabascli.net import free_port
from tests.engine_support import load, write_job


def net(momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 2)).double()


@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
def test_running_statistics_equal_one_process_feeding_the_micro_batches_in_worker_order(
    momentum: float | None,
) -> None:
    workers, replicas = 7, 3
    reference = net(momentum)
    models = [net(momentum) for _ in range(replicas)]
    sync = BufferSync(models, workers)
    rng = random.Random(0)
    for iteration in range(4):
        if iteration == 2:  # statistics changed between iterations (a state loaded in place): the next starts there
            state = reference.state_dict()
            shift = {"running_mean": 0.5, "running_var": 0.5, "num_batches_tracked": 3}
            moved = {k: v + shift.get(k.rsplit(".", 1)[-1], 0) for k, v in state.items()}
            for m in (reference, *models):
                m.load_state_dict(moved)
        batches = [torch.randn(5, 3, dtype=torch.float64) + iteration for _ in range(workers)]
        for x in batches:
            reference(x)
        sync.begin()
        order = list(range(workers))
        rng.shuffle(order)  # any replica may run any worker, in any order
        for k in order:
            r = rng.randrange(replicas)
            sync.before_micro_step(r, k)
            models[r](batches[k])
            sync.after_micro_step(r, k)
        sync.end_iteration()
    expected = reference.state_dict()
    for m in models:
        for name, value in m.state_dict().items():
            assert torch.allclose(value.double(), expected[name].double(), rtol=0, atol=1e-12), name
        assert int(m[1].num_batches_tracked) == 4 * workers + 3


def test_layers_in_eval_mode_keep_their_statistics() -> None:
    model = net(0.1)
    model[1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sync = BufferSync([model], workers=2)
    sync.begin()
    for k in range(2):
        sync.before_micro_step(0, k)
        model(torch.randn(4, 3, dtype=torch.float64))
        sync.after_micro_step(0, k)
    sync.end_iteration()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_sync_batchnorm_is_refused_with_a_reason() -> None:
    with pytest.raises(InputError, match="SyncBatchNorm"):
        BufferSync([nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))], workers=1)


def _trainer_rank(rank: int, world: int, port: int, config: str, out: str) -> None:
    torch.set_num_threads(1)
    env = DistEnv(rank, world, rank, "127.0.0.1", port)
    loaded = load(Path(config))
    plan = load_plan(loaded)
    init_process_group(env, torch.device("cpu"))
    try:
        trainer = Trainer(loaded, plan, rank, torch.device("cpu"), TrainOptions(max_steps=6, metrics=False))
        trainer.fit()
        states = [r.state_dict() for r in trainer.vsw.replicas]
        gathered: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, states)
        if rank == 0:
            torch.save([s for rank_states in gathered for s in rank_states], out)
    finally:
        # Free DDP (it holds the process group) before the group goes, as run_trainer does: left to the
        # interpreter, gloo's threads may be torn down out of order and abort the process (seen in CI).
        trainer = None
        gc.collect()
        dist.destroy_process_group()


def test_every_replica_on_every_rank_ends_with_the_same_parameters_and_buffers(tmp_path: Path) -> None:
    options = {"counter": True}  # plus a buffer that is not BatchNorm's, counting differently on every rank
    config = write_job(
        tmp_path, [(2, 1), (1, 0), (3, 0)], vsw_strategy="streams", weight_sync="overlap", options=options
    )
    out = tmp_path / "states.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_trainer_rank, args=(3, free_port(), str(config), str(out)), nprocs=3)
    states = torch.load(out, weights_only=True)
    assert len(states) == 2 + 1 + 3  # every replica of every rank
    assert float(states[0]["0.seen"]) == 6 * 2 * 4  # rank 0, replica 0: 6 iterations of 2 micro-batches of 4
    for other in states[1:]:
        for name, value in states[0].items():
            assert torch.equal(value, other[name]), name
