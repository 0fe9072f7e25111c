"""Hybrid layouts: what each rank holds, and iteration time, against plain replicas (DDP), side by side.

Two gloo processes train the tiny GPT (Adam, float32) under each layout of
``[parallel]`` that the runtime builds (:mod:`jabascli.engine.parallel`): plain
replicas with DDP, ``sharding = "full"``, ``tp = 2``, ``pp = 2`` with even and
with unequal stages, and ``checkpointing = "full"`` (sharded). After
``--iterations`` iterations of ``--micro-batches`` micro-batches of ``--lbs``
samples per replica, each rank reports the bytes it holds of parameters,
gradients and optimizer state (local shards only), and the median iteration
time; the script prints the largest rank of each layout and its ratio to DDP::

    layout           params    grads     optim     total     x DDP   iteration
    ddp              ...

Run: ``.venv/bin/python benchmarks/hybrid_parallel.py [--variant tiny --iterations 10 --lbs 8]``.
(Issue 20's target: ``sharding = "full"`` over 2 ranks holds at most 0.6x of DDP's total.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from jabascli.engine.parallel.layout import Layout
from jabascli.engine.parallel.pipeline import PipelineMicroBatches
from jabascli.engine.parallel.replica import build_replica
from jabascli.engine.parallel.sharding import ShardedMicroBatches
from jabascli.net import free_port
from jabascli.workload import load_workload

LAYOUTS: dict[str, Layout | None] = {
    "ddp": None,
    "sharding full": Layout(1, 1, ((0, 3),), "1f1b", "full", ()),
    "tp 2": Layout(2, 1, ((0, 3),), "1f1b", "none", ()),
    "pp 2 (2+2)": Layout(1, 2, ((0, 1), (2, 3)), "1f1b", "none", ()),
    "pp 2 (3+1)": Layout(1, 2, ((0, 2), (3, 3)), "1f1b", "none", ()),
    "full + ckpt": Layout(1, 1, ((0, 3),), "1f1b", "full", (0, 1, 2, 3)),
}


def local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    workload = load_workload("gpt", {"variant": args.variant})
    results = {}
    for name, layout in LAYOUTS.items():
        torch.manual_seed(0)
        model = workload.build_model()
        count = args.micro_batches * (world if layout is not None and (layout.tp > 1 or layout.pp > 1) else 1)
        workers = count * (1 if layout is not None and (layout.tp > 1 or layout.pp > 1) else world)
        pipeline = sharded = None
        if layout is None:
            model = DistributedDataParallel(model)
        else:
            replica = build_replica(model, workload, layout, "cpu")
            model = replica.model
            if layout.pp > 1:
                group = replica.mesh["pp"].get_group()
                pipeline = PipelineMicroBatches(
                    model, replica.stage, layout.pp, torch.device("cpu"), "1f1b", workload.loss, workers, group
                )
            elif replica.units:
                sharded = ShardedMicroBatches(model, replica.units, layout.sharding)
        optimizer = workload.optimizer(model.parameters())
        inputs, target = workload.synthetic_batch(args.lbs * count)
        chunks = list(zip(inputs.chunk(count), target.chunk(count), strict=True))

        def step(module: Any, replica: int, mb: Any, *, sync: bool = False, workers: int = workers) -> None:
            (workload.loss(module(mb[0]), mb[1]) / workers).backward()

        times = []
        for _ in range(args.iterations):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            if pipeline is not None:
                pipeline.run(count, inputs, target)
            elif sharded is not None:
                sharded.run(chunks, step, equal=True)
            else:  # DDP, or a TP replica (no DP dimension to synchronise)
                with model.no_sync() if layout is None else contextlib.nullcontext():
                    for mb in chunks[:-1]:
                        step(model, 0, mb)
                step(model, 0, chunks[-1])
            optimizer.step()
            times.append(time.perf_counter() - start)
        params = list(model.parameters())
        state = [v for s in optimizer.state.values() for v in s.values()]
        held = (local_bytes(params), local_bytes(p.grad for p in params), local_bytes(state))
        results[name] = (*held, statistics.median(times[1:]))
        del model, optimizer
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="tiny", help="gpt variant (tiny: 4 blocks; small: 12 blocks, 163 M)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=2, help="per rank (a TP or PP replica runs both's)")
    parser.add_argument("--lbs", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result")
        mp.spawn(rank_main, args=(2, free_port(), args, out), nprocs=2)
        ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    print(f"gpt {args.variant}, 2 gloo ranks, Adam float32, LBS {args.lbs}; bytes held by the largest rank")
    print(f"{'layout':<16} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9} {'x DDP':>6} {'iteration':>10}")
    ddp_total = max(sum(r["ddp"][:3]) for r in ranks)
    for name in LAYOUTS:
        worst = max(ranks, key=lambda r: sum(r[name][:3]))[name]
        total = sum(worst[:3])
        time_ms = max(r[name][3] for r in ranks) * 1e3
        print(
            f"{name:<16} {worst[0]:>9,} {worst[1]:>9,} {worst[2]:>9,} {total:>9,} {total / ddp_total:>6.2f} "
            f"{time_ms:>8.1f}ms"
        )


if __name__ == "__main__":
    main()
