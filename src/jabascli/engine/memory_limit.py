"""Emulated memory limits: a trainer on an emulated device runs out of memory as that GPU would.

An emulated server's ``emulate.memory_bytes`` is its device's memory. The
trainer of such a rank measures what the memory profiler measures on the CPU
(:class:`~jabascli.memtrack.TensorMemoryTracker`: the peak of bytes held by
tensors, the analogue of ``torch.cuda.max_memory_allocated``)::

    peak = static + max over the watched iterations of (bytes of live tensors created since)
    static = parameters and buffers of every VSW replica + one gradient per parameter of
             replica 0 (DDP's buckets) + optimizer state that exists already (after a resume)

A layout's gradients are not in ``static``: it drops them after each step, so each
backward makes them anew and they count then (counted in both, they were counted twice).

Under a ``[parallel]`` layout it counts what THIS rank holds: the local shard or
TP slice of every ``DTensor`` parameter, its gradient and optimizer state, only
the stage's blocks with pipeline stages; so a model whose optimizer state does
not fit one device trains sharded over several.

and the first allocation that takes it over the budget fails the trainer with
"out of memory on emulated device ...", exit 1 through ``jabas run``: a plan
that would not fit is caught on a laptop. The batches, activations, gradients
of the other replicas and the optimizer state made by the first step count
as they are created. The dataset does not (it lives in host memory on a GPU
machine too): views of it and in-place updates of existing tensors add nothing.

**Cost**: the tracker sees every operator in Python, so it watches only the
first :data:`WATCHED_ITERATIONS` iterations of every trainer (the memory
profiler's trials run 3); every later iteration repeats the same allocations
at the same LBS and VSW count and costs nothing extra. A resume builds a new
trainer, which is watched again; whoever changes the plan in place (new LBS,
VSW replicas rebuilt) calls :meth:`MemoryLimit.start` again, which counts the
new replicas and watches the next iterations. Ranks that are not emulated
never pay. What it cannot catch: a workload whose memory grows later
(variable-length batches larger than those of the first iterations), and
batches made by DataLoader worker processes (``loader_workers``, 0 by default
on emulated devices), which arrive in shared memory.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from jabascli.errors import JabasError, RuntimeFailure
from jabascli.memtrack import TensorMemoryTracker

WATCHED_ITERATIONS = 3
_NOTHING = contextlib.nullcontext()


class MemoryLimit:
    """Watches the first iterations of an emulated rank against its memory budget (module docstring)."""

    def __init__(self, budget: int | None, device: str) -> None:
        self.budget = budget
        self.device = device
        self.left = WATCHED_ITERATIONS if budget is not None else 0
        self.tracker: TensorMemoryTracker | None = None

    @property
    def peak(self) -> int | None:
        """The peak seen so far (None when not watching)."""
        return None if self.tracker is None else self.tracker.peak

    def start(
        self, replicas: Iterable[nn.Module], optimizer: torch.optim.Optimizer, keeps_gradients: bool = True
    ) -> None:
        """Count what exists now and watch the next iterations; fails when that alone is over the budget.

        ``keeps_gradients``: replica 0's gradients are held between iterations, so they count from now on; else
        (a layout, which drops them after each step) they count as each backward makes them, and only then."""
        if self.budget is None:
            return
        self.left = WATCHED_ITERATIONS
        storages: dict[int, int] = {}
        gradients = 0
        for i, replica in enumerate(replicas):
            for t in [*replica.parameters(), *replica.buffers()]:
                storage = _held(t).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            if i == 0 and keeps_gradients:
                gradients = sum(_held(p).nbytes for p in replica.parameters() if p.requires_grad)
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    storage = _held(t).untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        self.tracker = TensorMemoryTracker(self.budget, baseline=sum(storages.values()) + gradients)
        if self.tracker.live > self.budget:
            raise self._error(self.tracker.live)

    def watch(self) -> AbstractContextManager[None]:
        """Around one iteration: track it while iterations are left to watch (later: nothing at all)."""
        if self.tracker is None or self.left <= 0:
            return _NOTHING
        return self._watched(self.tracker)

    @contextlib.contextmanager
    def _watched(self, tracker: TensorMemoryTracker) -> Iterator[None]:
        try:
            with tracker:
                yield
        except Exception:
            # However the error surfaced (autograd may wrap it), the tracker knows whether it raised it.
            if tracker.exceeded is None:
                raise
            raise self._error(tracker.exceeded.live) from None
        self.left -= 1

    def _error(self, peak: int) -> JabasError:
        return RuntimeFailure.at(
            None,
            None,
            f"out of memory on emulated device {self.device}: peak {peak:,} bytes over budget {self.budget:,} bytes",
        )


def _held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a ``DTensor``'s local shard or slice (``[parallel]`` layouts), else ``t``.

    DTensor is looked up, not imported: a plain IIDP trainer never loads it (a second to import), and no
    tensor can be a DTensor before its module is loaded."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t
