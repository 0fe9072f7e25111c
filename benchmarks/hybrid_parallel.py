"""Hybrid layouts: what each rank holds, and iteration time, against plain replicas (DDP), side by side.

**Memory.** ``--world`` gloo processes train a GPT or ViT (Adam, float32) under
each layout of ``[parallel]`` the runtime builds (:mod:`jabascli.engine.parallel`)
and the world size allows: plain replicas with DDP, ``sharding = "full"``,
``checkpointing = "full"`` (plain replicas), both, ``tp = 2`` and ``pp = 2``
(``world / (tp x pp)`` replicas whose gradients meet over the DP
dimension), and on 4 ranks ``tp = 2`` or ``pp = 2`` sharded over their 2
replicas. After ``--iterations`` iterations of ``--micro-batches``
micro-batches of ``--lbs`` samples per device, each rank reports the bytes it
holds of parameters, gradients and optimizer state (its local shards only) and
the peak bytes of the tensors one iteration creates on it (activations,
gathered parameters, optimizer temporaries: ``iter. peak``), counted as
:mod:`jabascli.memtrack` counts an emulated device, with DTensor operations
counted by their local tensors. The largest rank of each layout is printed with
its ratio to DDP (params + grads + optimizer state) and the median iteration time.

**Mixed pipeline** (``--mixed``): two ranks, ``pp = 2`` with one stage each; the
first stage's device is emulated 3x slower (every block's forward and backward
sleeps twice its CPU time, as ``[cluster] emulate.slowdown`` does), the second is
the fast one. A deep narrow GPT (8 blocks of width 64, vocabulary 64, so the head
costs little) trains with the even split (4 + 4 blocks) and with the split that
gives the slow stage fewer blocks (2 + 6), side by side in one run::

    mixed pipeline, slow stage 3x: even 4+4 blocks 412.0 ms, 2+6 blocks 230.0 ms, 1.79x faster

Run: ``.venv/bin/python benchmarks/hybrid_parallel.py [--model gpt --variant tiny --world 2] [--mixed]``.
``--variant small`` (GPT-2 small, 163 M parameters, with ``--context 32``) and ``--model vit --variant
vit_b16`` are the medium models. Issue 20's targets: ``sharding = "full"`` over 2 ranks holds at most
0.6x of DDP's total; the mixed pipeline's unequal split at least 1.5x faster than the even one.
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
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from jabascli.builtin_models import gpt
from jabascli.engine.parallel.layout import Layout, stage_ranges
from jabascli.engine.parallel.pipeline import PipelineMicroBatches
from jabascli.engine.parallel.replica import build_replica
from jabascli.engine.parallel.sharding import ShardedMicroBatches
from jabascli.engine.vsw import Emulation
from jabascli.memtrack import TensorMemoryTracker
from jabascli.net import free_port
from jabascli.workload import Workload, load_workload

SLOWDOWN = 3.0


def layouts(blocks: int, world: int) -> dict[str, Layout | None]:
    """Every layout this world size can run, by name (None: DDP)."""
    every = tuple(range(blocks))
    whole = ((0, blocks - 1),)
    candidates: dict[str, Layout | None] = {
        "ddp": None,
        "sharding full": Layout(1, 1, whole, "1f1b", "full", ()),
        "checkpointing": Layout(1, 1, whole, "1f1b", "none", every),
        "full + ckpt": Layout(1, 1, whole, "1f1b", "full", every),
    }
    if world % 2 == 0:
        candidates["tp 2"] = Layout(2, 1, whole, "1f1b", "none", ())
        candidates["pp 2"] = Layout(1, 2, tuple(stage_ranges(blocks, 2, None)), "1f1b", "none", ())
    if world % 4 == 0:  # several replicas to shard over
        candidates["tp 2 + full"] = Layout(2, 1, whole, "1f1b", "full", ())
        candidates["pp 2 + full"] = Layout(1, 2, tuple(stage_ranges(blocks, 2, None)), "1f1b", "full", ())
    return candidates


class LocalTensorTracker(TensorMemoryTracker):
    """The tracker, letting DTensor run its operations on local tensors first, which it then counts."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


def local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def options(args: argparse.Namespace) -> dict[str, Any]:
    if args.model == "gpt":
        return {"variant": args.variant} | ({"context": args.context} if args.context else {})
    return {"variant": args.variant} | ({"image_size": args.context} if args.context else {})


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    workload = load_workload(args.model, options(args))
    torch.manual_seed(0)
    blocks = len(workload.blocks(workload.build_model()) or [])
    results = {}
    for name, layout in layouts(blocks, world).items():
        results[name] = run_layout(workload, layout, world, args)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def run_layout(workload: Workload, layout: Layout | None, world: int, args: argparse.Namespace) -> tuple:
    """(params, grads, optimizer state, iteration peak) bytes on this rank, and the median iteration seconds."""
    torch.manual_seed(0)
    model = workload.build_model()
    size = 1 if layout is None else layout.tp * layout.pp
    count = args.micro_batches * size  # a replica runs the micro-batches of its devices
    workers = args.micro_batches * world  # GBS / LBS
    pipeline = sharded = replica = None
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

    def step(module: Any, replica_index: int, mb: Any, *, sync: bool = False) -> None:
        (workload.loss(module(mb[0]), mb[1]) / workers).backward()

    def iteration() -> None:
        optimizer.zero_grad(set_to_none=False)
        if pipeline is not None:
            pipeline.run(count, inputs, target)
        elif sharded is not None:
            sharded.run(chunks, step, equal=True)
        else:  # DDP synchronises in the last backward; plain layouts in sync_gradients
            with model.no_sync() if layout is None else contextlib.nullcontext():
                for mb in chunks[:-1]:
                    step(model, 0, mb)
            step(model, 0, chunks[-1])
        if replica is not None:
            replica.sync_gradients()
        optimizer.step()

    times = []
    for _ in range(args.iterations + 1):  # the first builds gradients and optimizer state: not timed
        dist.barrier()
        start = time.perf_counter()
        iteration()
        times.append(time.perf_counter() - start)
    dist.barrier()
    with LocalTensorTracker() as tracker:
        iteration()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    held = (local_bytes(params), local_bytes(p.grad for p in params), local_bytes(state))
    return (*held, tracker.peak, statistics.median(times[1:]))


def slow_blocks(blocks: list[nn.Module], emulation: Emulation) -> None:
    """Every block's forward and backward emulated ``slowdown`` times slower (sleeps after each)."""
    for block in blocks:
        starts: dict[str, float] = {}

        def begin(key: str, starts: dict[str, float] = starts) -> Any:
            return lambda *_: starts.__setitem__(key, emulation.clock())

        def end(key: str, starts: dict[str, float] = starts) -> Any:
            return lambda *_: emulation.pause_since(starts.pop(key))

        block.register_forward_pre_hook(begin("forward"))
        block.register_forward_hook(end("forward"))
        block.register_full_backward_pre_hook(begin("backward"))
        block.register_full_backward_hook(end("backward"))


MIXED_SPLITS = {"even 4+4": ((0, 3), (4, 7)), "2+6": ((0, 1), (2, 7))}


def mixed_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Rank 0: the slow stage (emulated ``SLOWDOWN`` x); rank 1: the fast one."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    workload = load_workload("gpt", {"variant": "tiny"})  # its blocks and pipeline_stage; the model is deeper
    count, lbs = 8, 16
    results = {}
    for name, stages in MIXED_SPLITS.items():
        torch.manual_seed(0)
        model = gpt.GPT(blocks=8, width=64, heads=4, context=16, vocabulary=64, dropout=0.0)
        replica = build_replica(model, workload, Layout(1, 2, stages, "1f1b", "none", ()), "cpu")
        if rank == 0:
            slow_blocks(workload.blocks(replica.model) or [], Emulation(SLOWDOWN))
        pipeline = PipelineMicroBatches(
            replica.model,
            replica.stage,
            2,
            torch.device("cpu"),
            "1f1b",
            workload.loss,
            count,
            replica.mesh["pp"].get_group(),
        )
        optimizer = workload.optimizer(replica.model.parameters())
        tokens = torch.randint(0, 64, (lbs * count, 17))
        times = []
        for _ in range(args.iterations + 1):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            pipeline.run(count, tokens[:, :-1], tokens[:, 1:])
            optimizer.step()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[1:])
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def spawn(main: Any, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result")
        mp.spawn(main, args=(world, free_port(), args, out), nprocs=world)
        return [torch.load(f"{out}.{r}") for r in range(world)]


def print_memory(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"{args.model} {args.variant}, {args.world} gloo ranks, Adam float32, LBS {args.lbs}, "
        f"{args.micro_batches} micro-batches per device; bytes of the largest rank"
    )
    header = ("layout", "params", "grads", "optim", "total", "x DDP", "iter. peak", "iteration")
    print(
        f"{header[0]:<14}" + "".join(f"{h:>14}" for h in header[1:5]) + f"{header[5]:>7}{header[6]:>14}{header[7]:>11}"
    )
    ddp_total = max(sum(r["ddp"][:3]) for r in ranks)
    for name in ranks[0]:
        worst = max(ranks, key=lambda r: sum(r[name][:3]))[name]
        total = sum(worst[:3])
        peak = max(r[name][3] for r in ranks)
        time_ms = max(r[name][4] for r in ranks) * 1e3
        sizes = "".join(f"{v:>14,}" for v in (*worst[:3], total))
        print(f"{name:<14}{sizes}{total / ddp_total:>7.2f}{peak:>14,}{time_ms:>9.1f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=["gpt", "vit"])
    parser.add_argument(
        "--variant", default="tiny", help="gpt: tiny, small (163 M); vit: tiny, vit_b16 (87 M), large, huge"
    )
    parser.add_argument("--context", type=int, default=None, help="gpt: tokens per sample; vit: image side")
    parser.add_argument("--world", type=int, default=2, help="gloo processes (2 to 4)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=2, help="per device (a TP or PP replica runs all its)")
    parser.add_argument("--lbs", type=int, default=8)
    parser.add_argument("--mixed", action="store_true", help="also the mixed pipeline: even split vs 2+6")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print_memory(spawn(rank_main, args.world, args), args)
    if args.mixed:
        times = max(spawn(mixed_main, 2, args), key=lambda r: r["2+6"])  # every rank times the same iterations
        even, split = times["even 4+4"], times["2+6"]
        print(
            f"mixed pipeline, slow stage {SLOWDOWN:g}x: even 4+4 blocks {even * 1e3:.1f} ms, "
            f"2+6 blocks {split * 1e3:.1f} ms, {even / split:.2f}x faster"
        )


if __name__ == "__main__":
    main()
