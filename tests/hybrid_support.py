"""One rank of a hybrid-layout IIDP job on gloo, for the hybrid exactness tests.

``python -m tests.hybrid_support CONFIG RANK WORLD PORT OUT``: trains the config's job with its
``[parallel]`` layout (:mod:`jabascli.engine.parallel`) over every iteration of its epochs, each
replica (TP group) running the micro-batches the plan deals to its ranks; rank 0 writes the whole
model's parameters to OUT (with pipeline stages, each rank its stage's to OUT.<rank>).

Checkpoints (after the five arguments): ``--store DIR --save-every K`` saves every K iterations into the
checkpoint store DIR, ``--stop-at S`` stops after S iterations, ``--resume PATH`` restores PATH (a checkpoint
or a store's folder: its newest intact one) and trains on from there. A hybrid layout saves and restores with
:mod:`jabascli.engine.parallel.dcp`; a plain layout on one process as the plain trainer does
(``save_checkpoint``, ``read_checkpoint`` + ``restore_checkpoint``), so the cases cross the two.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from jabascli.config import load_config
from jabascli.engine.checkpoint import (
    CheckpointState,
    Progress,
    extra_payload,
    read_checkpoint,
    resolve_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.data import BatchLoader, seed_worker
from jabascli.engine.parallel.dcp import save_sharded
from jabascli.engine.parallel.layout import Layout, resolve_layout
from jabascli.engine.parallel.pipeline import PipelineMicroBatches
from jabascli.engine.parallel.replica import build_replica, replica_micro_batches
from jabascli.engine.parallel.runner import restore_layout_checkpoint
from jabascli.engine.parallel.sharding import ShardedMicroBatches
from jabascli.engine.plan import load_plan
from jabascli.engine.sampler import IIDPSampler, MicroBatch
from jabascli.engine.vsw import Emulation
from jabascli.workload import load_workload


def main(config: str, rank: int, world: int, port: int, out: str, checkpoints: argparse.Namespace) -> None:
    loaded = load_config(config)
    cfg, plan = loaded.config, load_plan(loaded)
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    torch.manual_seed(cfg.job.seed)
    model = workload.build_model()
    blocks = workload.blocks(model)
    layout = resolve_layout(loaded, workload, None if blocks is None else len(blocks))
    assert layout is not None
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        replica = build_replica(model, workload, layout, "cpu")
        model, cpu = replica.model, torch.device("cpu")
        optimizer = workload.optimizer(model.parameters())  # after: over the stage's shards and TP slices
        train_set = workload.train_dataset()
        load = BatchLoader(train_set, torch.device("cpu"), workload.collate)
        sampler = IIDPSampler(len(train_set), cfg.job.seed)
        runner = ShardedMicroBatches(model, replica.units, layout.sharding) if replica.units else None
        pipeline = None
        if layout.pp > 1:
            pipe_group = replica.mesh["pp"].get_group()
            pipeline = PipelineMicroBatches(
                replica.model, replica.stage, layout.pp, cpu, layout.schedule, workload.loss, plan.workers, pipe_group
            )
        size = layout.tp * layout.pp  # ranks per replica: replica i is ranks i x size ...
        equal = len({sum(plan.rank(r).micro_steps for r in range(i, i + size)) for i in range(0, world, size)}) == 1
        emulation = Emulation(plan.rank(rank).slowdown)  # an emulated slow server: slower, same values
        whole_model = layout.plain and world == 1  # saved and restored as the plain trainer does
        progress = Progress()
        if checkpoints.resume is not None:
            progress = _restore(Path(checkpoints.resume), whole_model, model, optimizer)

        def step(module: torch.nn.Module, replica: int, mb: MicroBatch, *, sync: bool = False) -> None:
            start = emulation.clock()
            seed_worker(mb.seed, torch.device("cpu"))
            inputs, target = load(mb.indices)
            (workload.loss(module(inputs), target) / plan.workers).backward()
            emulation.pause_since(start)

        for epoch in range(progress.epoch, cfg.job.epochs):
            start = progress.position if epoch == progress.epoch else 0
            progress.epoch, progress.position = epoch, start
            for iterations in zip(
                *(sampler.rank_iterations(epoch, start, plan, r) for r in replica.ranks), strict=True
            ):
                if progress.step == checkpoints.stop_at:
                    return
                optimizer.zero_grad()
                micro_batches = replica_micro_batches(iterations)
                if pipeline is not None:
                    inputs, target = load([i for mb in micro_batches for i in mb.indices])
                    pipeline.run(len(micro_batches), inputs, target)
                elif runner is not None:
                    runner.run(micro_batches, step, equal)
                else:
                    for mb in micro_batches:
                        step(model, 0, mb)
                replica.sync_gradients()  # several replicas: their whole parameters' gradients summed
                optimizer.step()
                progress.step, progress.position = progress.step + 1, progress.position + plan.gbs
                if checkpoints.save_every and progress.step % checkpoints.save_every == 0:
                    _save(CheckpointStore(Path(checkpoints.store)), progress, whole_model, model, optimizer, layout)
        whole = replica.full_state_dict()  # with pp: this stage's part; rank r writes OUT.r
        if rank == 0 or layout.pp > 1:
            torch.save(whole, out if layout.pp == 1 else f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _save(
    store: CheckpointStore,
    progress: Progress,
    whole_model: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: Layout,
) -> None:
    plan = {} if whole_model else {"layout": repr(layout)}
    state = CheckpointState(
        model, optimizer, scheduler=None, progress=progress, workload="hybrid", config={}, plan=plan
    )
    if whole_model:
        save_checkpoint(store, state)
    else:
        extra = extra_payload(state)
        save_sharded(store, step=progress.step, epoch=progress.epoch, model=model, optimizer=optimizer, extra=extra)


def _restore(path: Path, whole_model: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
    found = resolve_checkpoint(path).path  # a store's folder: its newest intact checkpoint
    if whole_model:
        return restore_checkpoint(read_checkpoint(found), found, model=model, optimizer=optimizer, scheduler=None)
    _, progress = restore_layout_checkpoint(found, model=model, optimizer=optimizer, scheduler=None)
    return progress  # as a trainer under a layout resumes


def command() -> None:
    """``python -m tests.hybrid_support CONFIG RANK WORLD PORT OUT [--store ...]``, or forked with that argv."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--resume")
    checkpoints = parser.parse_args(sys.argv[6:])
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], checkpoints)
    # Done, its files written and the group destroyed: skip the interpreter's teardown, where gloo's
    # threads, destroyed out of order under load, can abort the process ("terminate called without
    # an active exception") after the work is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    command()
