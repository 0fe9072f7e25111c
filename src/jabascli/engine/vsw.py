"""Virtual stream workers: how one rank runs its ``VSW * (GA + 1)`` worker micro-steps.

Two strategies behind one interface (:class:`VswStrategy`):

* ``sequential``: one model replica; the micro-batches run one after another
  and their gradients accumulate in it. Least memory; runs everywhere.
* ``streams``: one replica per VSW. On CUDA, replicas 1.. run on their own
  ``torch.cuda.Stream`` and replica 0 on the current stream, so the VSWs'
  kernels overlap; their gradients are added into replica 0's buckets just
  before each bucket's all-reduce (see :mod:`jabascli.engine.weight_sync`). On
  the CPU the replicas run in turn, which is how CI tests this path.

In both, only the rank's last micro-step (on replica 0) runs a synchronising
backward; every other micro-step runs under ``no_sync``, so there is one
all-reduce per bucket per iteration.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jabascli.engine.buffers import BufferSync
from jabascli.engine.data import BatchLoader, seed_worker
from jabascli.engine.loader import MicroBatchFeed
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import MicroBatch
from jabascli.engine.step_policy import Precision
from jabascli.engine.timing import PhaseTimer

VSW_STRATEGIES = ("sequential", "streams")


class Emulation:
    """An emulated slower device: after each compute step, sleep ``(slowdown - 1) x`` its measured time.

    When torch computes on one thread, a step is timed by that thread's CPU
    time (:meth:`clock`), not by the wall clock: the device emulated is
    ``slowdown`` times slower than the work this CPU did for it, however long
    the process waited for a core meanwhile. With wall-clock time, every
    millisecond the trainer spent preempted (by the other trainers on this
    machine, their communication threads, other jobs) was slept again
    ``slowdown - 1`` times, so an emulated device got slower the busier the
    machine was. (Unhindered, the two clocks agree: the profiler's wall-clock
    times stay valid.) With several intra-op threads the calling thread does
    only part of the work, so the wall clock is used.

    A synchronising backward is timed up to the moment its last gradient is
    computed (:meth:`backward_done`, called from the communication hook), so the
    sleep delays that rank's last all-reduce and never counts time spent
    waiting for other ranks.

    A sleep ends late (timer slack, the scheduler; a tenth of a millisecond or
    more on a virtual machine), and a rank sleeps twice per micro-step: the time
    overslept is taken off the next sleep, so that the rank's total delay is the
    one asked for rather than growing with the number of sleeps.
    """

    def __init__(self, slowdown: float) -> None:
        self.extra = max(slowdown - 1.0, 0.0)
        self._backward_start: tuple[int, float] | None = None
        self._overslept = 0.0

    @property
    def active(self) -> bool:
        return self.extra > 0

    def clock(self) -> float:
        """What a step is timed with, in seconds: the thread's CPU time when it does all of torch's work.

        0 when not emulating: nothing is timed, so a plain rank's micro-steps pay nothing for it.
        """
        if not self.extra:
            return 0.0
        return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()

    def pause_since(self, start: float) -> None:
        """Sleep ``(slowdown - 1)`` times the CPU time this thread spent since ``start`` (from :meth:`clock`)."""
        if self.extra > 0:
            self._sleep(self.extra * (self.clock() - start))

    def _sleep(self, seconds: float) -> None:
        wanted = seconds - self._overslept
        if wanted <= 0:
            self._overslept = -wanted
            return
        start = time.perf_counter()
        time.sleep(wanted)
        self._overslept = time.perf_counter() - start - wanted

    def backward_started(self) -> None:
        if self.extra:
            self._backward_start = (threading.get_ident(), self.clock(), time.perf_counter())

    def backward_done(self) -> None:
        # On the CPU the autograd engine runs the backward, and so the communication hook, on the
        # thread that started it; elsewhere a thread's CPU time means nothing, and the wall clock serves.
        if self._backward_start is not None:
            thread, start, wall_start = self._backward_start
            self._backward_start = None
            if thread == threading.get_ident():
                self.pause_since(start)
            elif self.extra > 0:
                self._sleep(self.extra * (time.perf_counter() - wall_start))


@dataclass
class WorkerStep:
    """One worker micro-step: seed, load, forward, scaled backward, buffer terms, emulated slowdown."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    load: BatchLoader
    workers: int
    """GBS / LBS: every worker's mean loss is divided by it."""
    buffers: BufferSync
    emulation: Emulation
    loss_weight: float = 1.0
    """This rank's micro-batches' share of the GBS mean loss against an even plan's worker (``LBS_r * W / GBS``,
    :meth:`~jabascli.engine.plan.TrainingPlan.loss_weight`): 1 but in an uneven plan."""
    loss_sum: torch.Tensor | None = None
    """The sum of the (weighted, unscaled) losses of the rank's micro-steps so far in this iteration."""
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    """Phase boundaries (see :mod:`jabascli.engine.timing`); only the computation profiler records them."""
    precision: Precision = field(default_factory=Precision)
    """Autocast for the forward, loss scaling for the backward (:mod:`jabascli.engine.step_policy`)."""
    feed: MicroBatchFeed | None = None
    """Micro-batches loaded ahead by DataLoader workers (:mod:`jabascli.engine.loader`); None: ``load`` here."""
    observer: Callable[[int, MicroBatch], None] | None = None
    """Called with (replica, micro-batch) after every backward (adaptive batching's measurement)."""

    def begin(self) -> None:
        self.loss_sum = None

    def __call__(self, module: nn.Module, replica: int, mb: MicroBatch, *, sync: bool = False) -> None:
        timer = self.timer
        seed_worker(mb.seed, self.load.device)  # a worker's randomness follows its samples, not the plan
        inputs, target = self.load(mb.indices) if self.feed is None else self.feed.take(mb)
        timer.mark("data")
        self.buffers.before_micro_step(replica, mb.worker)
        start = self.emulation.clock()
        with self.precision.autocast():
            output = module(*inputs) if isinstance(inputs, tuple) else module(inputs)
            loss = self.loss_fn(output, target)
            if self.loss_weight != 1.0:
                loss = loss * self.loss_weight
        self.emulation.pause_since(start)
        self.buffers.after_micro_step(replica, mb.worker)
        self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
        timer.mark("fwd")
        if sync:
            # All of the rank's forwards are done: start the statistics-and-loss all-reduce, so that
            # it overlaps this backward.
            self.buffers.launch(self.loss_sum)
            timer.mark("overhead")
            self.emulation.backward_started()  # the slowdown sleep happens before the last all-reduce
            self.precision.scale(loss / self.workers).backward()
        else:
            start = self.emulation.clock()
            self.precision.scale(loss / self.workers).backward()
            self.emulation.pause_since(start)
        if self.observer is not None:
            self.observer(replica, mb)
        timer.mark("bwd")


class VswStrategy:
    """Runs a rank's micro-batches of one iteration; replica 0 is the one the optimizer updates."""

    name = ""
    keeps_gradients = True
    """Replica 0's gradients live in DDP's buckets from one iteration to the next (zeroed in place)."""

    def __init__(self, replicas: Sequence[nn.Module], ddp: DistributedDataParallel) -> None:
        self.replicas = list(replicas)
        self.ddp = ddp
        self._params = [list(r.parameters()) for r in self.replicas]

    def run(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None:
        """Forward and backward of every micro-batch; the last backward synchronises."""
        raise NotImplementedError

    def replica_params(self) -> list[list[nn.Parameter]]:
        """The parameters of replicas 1.., whose gradients the communication hook adds into replica 0's buckets."""
        return []

    def zero_grad(self) -> None:
        # Replica 0's gradients are views into DDP's buckets: zero them in place to keep the views.
        grads = [p.grad for p in self._params[0] if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def after_step(self) -> None:
        """Bring the other replicas' parameters up to date with replica 0's."""

    # -- validation (the trainer's; a [parallel] layout's workers answer the same calls) ---------

    def share(self, plan: TrainingPlan, rank: int) -> tuple[int, int]:
        """(first worker, workers) of the validation set's share this rank evaluates: its own workers'."""
        return plan.worker_offset(rank), plan.rank(rank).micro_steps

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def forward(self, inputs: Any) -> Any:
        """Replica 0's output for a validation batch."""
        model = self.replicas[0]
        return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


class SequentialVsw(VswStrategy):
    """One replica; the VSWs' micro-batches run one after another (see the module docstring)."""

    name = "sequential"

    def run(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None:
        *local, last = micro_batches
        with self.ddp.no_sync():
            for mb in local:
                step(self.ddp, 0, mb)
        step(self.ddp, 0, last, sync=True)


class StreamsVsw(VswStrategy):
    """One replica per VSW; on CUDA, replicas 1.. each run on their own stream (in turn on the CPU).

    Replica 0 runs on the current stream, with DDP. Stream order, per iteration:
    every replica stream first waits for the current stream (updated parameters,
    zeroed statistics), and the current stream waits for all of them before
    replica 0's synchronising backward, whose communication hook reads their
    gradients.
    """

    name = "streams"

    def __init__(self, replicas: Sequence[nn.Module], ddp: DistributedDataParallel) -> None:
        super().__init__(replicas, ddp)
        cuda = self._params[0][0].is_cuda
        self.streams = [torch.cuda.Stream() for _ in self.replicas[1:]] if cuda else None

    def replica_params(self) -> list[list[nn.Parameter]]:
        return self._params[1:]

    def run(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None:
        by_replica: list[list[MicroBatch]] = [[] for _ in self.replicas]
        for mb in micro_batches:
            by_replica[mb.vsw].append(mb)
        for v in range(1, len(self.replicas)):
            with self._on_stream(v):
                for mb in by_replica[v]:
                    step(self.replicas[v], v, mb)
        *local, last = by_replica[0]
        with self.ddp.no_sync():
            for mb in local:
                step(self.ddp, 0, mb)
        if self.streams is not None:
            for stream in self.streams:
                torch.cuda.current_stream().wait_stream(stream)
        step(self.ddp, 0, last, sync=True)

    def zero_grad(self) -> None:
        super().zero_grad()
        for replica in self.replicas[1:]:
            replica.zero_grad(set_to_none=True)

    def after_step(self) -> None:
        # On the current stream: the replica streams wait for it before their next use.
        with torch.no_grad():
            for params in self._params[1:]:
                torch._foreach_copy_(params, self._params[0])

    def _on_stream(self, v: int) -> Any:
        if self.streams is None:
            return contextlib.nullcontext()
        stream = self.streams[v - 1]
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)


def make_replicas(model: nn.Module, count: int) -> list[nn.Module]:
    """``model`` and ``count - 1`` deep copies of it."""
    return [model] + [copy.deepcopy(model) for _ in range(count - 1)]


def choose_vsw_strategy(requested: str, vsw: int, model: nn.Module, device: torch.device) -> tuple[str, str]:
    """(strategy, reason) for ``[job] vsw_strategy``: ``auto`` picks ``streams`` on CUDA when memory allows.

    "Memory allows" means the extra replicas' parameters and gradients take at
    most half of the free device memory; the activations of ``VSW`` concurrent
    workers are what the memory profile bounds (the solver never picks more
    VSWs than fit).
    """
    if requested in VSW_STRATEGIES:
        return requested, "set in [job] vsw_strategy"
    if vsw == 1:
        return "sequential", "one VSW"
    if device.type != "cuda":
        return "sequential", "no CUDA streams on the CPU"
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    needed = (vsw - 1) * 2 * param_bytes
    if needed <= free // 2:
        return "streams", f"{vsw - 1} extra replicas need {needed / 2**20:.0f} MiB of {free / 2**20:.0f} MiB free"
    return "sequential", f"{vsw - 1} extra replicas need {needed / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free"


def build_vsw_strategy(name: str, replicas: Sequence[nn.Module], ddp: DistributedDataParallel) -> VswStrategy:
    return {"sequential": SequentialVsw, "streams": StreamsVsw}[name](replicas, ddp)
