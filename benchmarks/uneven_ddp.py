"""Uneven-batch data parallelism: each device's local batch in proportion to its speed, the same SGD as one GBS.

The simplest rival to IIDP on a heterogeneous cluster (Lightning users ask for
it; Cephalo, Poplar and Cannikin build on it): plain DDP with one process per
device, where device ``i`` takes ``b_i`` of the iteration's ``GBS`` samples,
``b_i`` in proportion to its measured speed. It is synchronous SGD at GBS when
each rank's loss is its samples' loss *sum* divided by GBS (the workload's
mean loss times ``b_i / GBS``) and the gradients are *summed* across ranks
(a DDP communication hook; DDP's default averages, which would weigh a
sample on a small rank more than one on a large rank). BatchNorm is the
exception: its batch statistics are per rank, as in plain DDP.

It lives beside the benchmark as the rival a user would write, plain DDP and
nothing of jabas's engine: ``heterogeneous_efficiency.py`` measures jabas's
plans (its own uneven plans among them, docs/engine.md#uneven-plans) against
it, and ``tests/test_uneven_ddp.py`` checks it is exact.

An emulated slower device sleeps ``(slowdown - 1)`` times the thread CPU time
of its forward, and of its backward just before the last bucket's all-reduce,
as jabas's trainer does at one thread (:class:`jabascli.engine.vsw.Emulation`,
``GradientSync.before_last_bucket``), so both are slowed alike.

    .venv/bin/python benchmarks/uneven_ddp.py --workload digits --batches 48,16 --slowdowns 1,3 --steps 60
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from jabascli.engine.host_memory import keep_freed_memory
from jabascli.net import free_port
from jabascli.workload import load_workload


def split_batch(gbs: int, speeds: Sequence[float]) -> list[int]:
    """``gbs`` samples in proportion to ``speeds`` (largest remainders), at least one each."""
    if gbs < len(speeds) or any(s <= 0 for s in speeds):
        raise ValueError(f"cannot split {gbs} samples over speeds {list(speeds)}")
    shares = [gbs * s / sum(speeds) for s in speeds]
    batches = [max(1, int(x)) for x in shares]
    by_remainder = sorted(range(len(speeds)), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    i = 0
    while sum(batches) < gbs:
        batches[by_remainder[i % len(batches)]] += 1
        i += 1
    while sum(batches) > gbs:
        largest = max(range(len(batches)), key=lambda j: batches[j])
        batches[largest] -= 1
    return batches


@dataclass(frozen=True)
class UnevenSpec:
    """What the ranks train: rank ``r`` takes ``batches[r]`` samples of each GBS and runs ``slowdowns[r]`` slower."""

    workload: str
    options: dict[str, Any]
    batches: tuple[int, ...]
    slowdowns: tuple[float, ...]
    steps: int
    seed: int = 0
    dtype: str = "float32"
    record: bool = False
    """Save rank 0's first gradient and last parameters (``grads.npy``, ``params.npy``) in the output folder."""

    @property
    def gbs(self) -> int:
        return sum(self.batches)


class Emulation:
    """A slower device: sleep ``(slowdown - 1)`` times the thread CPU time of a step, the time overslept taken
    off the next sleep (the rule of :class:`jabascli.engine.vsw.Emulation` at one thread, which the engine
    imports with it; kept here so that a rank starts in half the time)."""

    def __init__(self, slowdown: float) -> None:
        self.extra = max(slowdown - 1.0, 0.0)
        self._overslept = 0.0

    @property
    def active(self) -> bool:
        return self.extra > 0

    def clock(self) -> float:
        return time.thread_time() if self.extra else 0.0

    def pause_since(self, start: float) -> None:
        if not self.extra:
            return
        wanted = self.extra * (self.clock() - start) - self._overslept
        if wanted <= 0:
            self._overslept = -wanted
            return
        began = time.perf_counter()
        time.sleep(wanted)
        self._overslept = time.perf_counter() - began - wanted


class _HookState:
    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation
        self.since = 0.0

    def start(self) -> None:
        self.since = self.emulation.clock()


# Unannotated on purpose: DDP checks the annotations' values, and this module's are strings.
def _sum_hook(state, bucket):  # (_HookState, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
    """Sum a bucket across ranks; before the last one, sleep for the emulated part of the backward."""
    if state.emulation.active and bucket.is_last():
        state.emulation.pause_since(state.since)
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _batch(dataset: Any, indices: list[int], collate: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    samples = [dataset[i] for i in indices]
    inputs, target = collate(samples) if collate is not None else torch.utils.data.default_collate(samples)
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        inputs = inputs.to(dtype)
    return inputs, target


def _rank(rank: int, spec: UnevenSpec, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # the host setting jabas's trainers run with: the two differ in parallelism, not malloc
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(spec.batches))
    try:
        _train(rank, spec, out)
        dist.barrier()  # leave together: one rank destroying the group while another still used it aborted that one
    finally:
        # Free DDP (it holds the group, in reference cycles) before the group goes, as the engine does
        # (engine/process.py): left to the interpreter's exit, gloo's threads went out of order and a rank aborted.
        gc.collect()
        dist.destroy_process_group()


def _train(rank: int, spec: UnevenSpec, out: Path) -> None:
    dtype = getattr(torch, spec.dtype)
    workload = load_workload(spec.workload, spec.options)
    torch.manual_seed(spec.seed)
    model = workload.build_model().to(dtype)
    ddp = DistributedDataParallel(model)
    state = _HookState(Emulation(spec.slowdowns[rank]))
    ddp.register_comm_hook(state, _sum_hook)
    optimizer = workload.optimizer(ddp.parameters())
    dataset = workload.train_dataset()
    collate = workload.collate
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(spec.seed)).tolist()
    first = sum(spec.batches[:rank])
    mine = spec.batches[rank]
    times: list[float] = []
    last = time.perf_counter()
    for step in range(spec.steps):
        begin = (step * spec.gbs) % (len(order) - spec.gbs + 1)
        inputs, target = _batch(dataset, order[begin + first : begin + first + mine], collate, dtype)
        optimizer.zero_grad(set_to_none=False)
        start = state.emulation.clock()
        output = ddp(*inputs) if isinstance(inputs, tuple) else ddp(inputs)
        loss = workload.loss(output, target) * (mine / spec.gbs)  # this rank's share of the GBS mean loss
        state.emulation.pause_since(start)
        state.start()
        loss.backward()  # the hook sums the buckets across ranks: the gradient of the GBS mean loss
        if spec.record and step == 0 and rank == 0:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
            np.save(out / "grads.npy", grads, allow_pickle=False)
        optimizer.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if rank == 0:
        if spec.record:
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()
            np.save(out / "params.npy", params, allow_pickle=False)
        (out / "times.json").write_text(json.dumps(times))


def train_uneven(spec: UnevenSpec, out: Path, timeout_s: float = 600) -> list[float]:
    """Train ``spec`` on one gloo process per rank (this file, run once per rank); rank 0's iteration times (s)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--spec", json.dumps(asdict(spec)), "--port", str(port)]
    ranks = [
        subprocess.Popen([*command, "--rank", str(r), "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(len(spec.batches))
    ]
    failed = []
    try:
        for r, process in enumerate(ranks):
            _, stderr = process.communicate(timeout=timeout_s)
            if process.returncode != 0:
                failed.append(f"rank {r} exited with {process.returncode}: {stderr.strip()[-1500:]}")
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    if failed:
        raise RuntimeError("; ".join(failed))
    return json.loads((out / "times.json").read_text())


def median_after_warmup(times: list[float], warmup: int = 5) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--options", default="{}", help="the workload's options, as JSON")
    parser.add_argument("--batches", default="48,16", help="each rank's local batch")
    parser.add_argument("--slowdowns", default="1,3", help="each rank's emulated slowdown")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # a rank of train_uneven: the spec as JSON
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        fields = json.loads(args.spec)
        fields.update(batches=tuple(fields["batches"]), slowdowns=tuple(fields["slowdowns"]))
        _rank(args.rank, UnevenSpec(**fields), args.port, args.out)
        return
    spec = UnevenSpec(
        args.workload,
        json.loads(args.options),
        tuple(int(b) for b in args.batches.split(",")),
        tuple(float(s) for s in args.slowdowns.split(",")),
        args.steps,
    )
    with tempfile.TemporaryDirectory(prefix="jabas-uneven-") as folder:
        times = train_uneven(spec, Path(folder))
    median = median_after_warmup(times)
    print(json.dumps({**asdict(spec), "median_s": median, "samples_per_s": spec.gbs / median}))


if __name__ == "__main__":
    main()
