"""Loading micro-batches in DataLoader worker processes (``[job] loader_workers``).

With ``loader_workers = 0`` (the default on a CPU or emulated device) every
micro-batch is loaded in the trainer, right after its worker's generators are
seeded (:class:`~jabascli.engine.data.BatchLoader`). With ``N > 0`` (default: 2
per GPU), a ``torch.utils.data.DataLoader`` with ``N`` persistent worker
processes loads them ahead:

* its sampler yields the rank's micro-batches in the order the IIDP sampler
  deals them (one item per micro-batch: its seed and its LBS sample indices),
  and the DataLoader calls the workload's dataset and ``collate`` for each in
  a worker, ``2 * N`` micro-batches ahead (``prefetch_factor``), into pinned
  memory on CUDA;
* **randomness follows the samples, as in the trainer**: the worker seeds
  torch, Python's ``random`` and NumPy from the micro-batch's seed before
  loading it, exactly as in-process loading does, and hands back the
  generators' states after loading with the batch; the trainer restores them
  before the forward, so dropout draws the numbers it would have drawn had
  the trainer loaded the batch itself. The result is the same parameters
  whatever ``loader_workers`` is (``tests/test_engine_exactness.py``).

**Contract: a new iteration stream means a new iterator.** The trainer hands
:meth:`MicroBatchFeed.follow` the iterations it is about to train (one epoch
from a position, under one plan); each call starts a new DataLoader iterator
(the worker processes stay), and torch's reset discards whatever the workers
had prefetched for the previous stream. So a plan change (adaptive batching),
a stop, or a resume (a new trainer) never trains a stale batch: whoever
changes the plan calls ``follow`` with the new plan's iterations.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from jabascli.engine.data import seed_worker, to_device
from jabascli.engine.sampler import Iteration, MicroBatch

DEFAULT_GPU_WORKERS = 2
"""``[job] loader_workers`` unset, per GPU trainer (CPU and emulated trainers load in-process)."""


def default_loader_workers(requested: int | None, device: torch.device) -> int:
    if requested is not None:
        return requested
    return DEFAULT_GPU_WORKERS if device.type == "cuda" else 0


class _MicroBatches(Dataset[Any]):
    """``dataset[(key, seed, indices)]``: one seeded, collated micro-batch and the generator states after it."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate
        self._getitems = getattr(dataset, "__getitems__", None)

    def __getitem__(self, item: tuple[int, int, list[int]]) -> tuple[int, Any, tuple[Any, Any, Any]]:
        key, seed, indices = item
        seed_worker(seed, torch.device("cpu"))
        samples = self._getitems(indices) if self._getitems is not None else [self.dataset[i] for i in indices]
        batch = self.collate(samples)
        return key, batch, (torch.get_rng_state(), random.getstate(), np.random.get_state())

    def __len__(self) -> int:
        return len(self.dataset)


def _as_loaded(item: Any) -> Any:
    return item


class _Schedule(Sampler[tuple[int, int, list[int]]]):
    """The DataLoader's sampler: the micro-batches of the stream set by :meth:`MicroBatchFeed.follow`."""

    def __init__(self) -> None:
        self.items: Iterator[tuple[int, int, list[int]]] = iter(())

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        return self.items


class MicroBatchFeed:
    """This rank's micro-batches, loaded ahead by DataLoader workers (module docstring)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None, device: torch.device, workers: int):
        self.device = device
        self.workers = workers
        self._schedule = _Schedule()
        self.loader = DataLoader(
            _MicroBatches(dataset, collate),
            batch_size=None,  # each item is a whole micro-batch
            collate_fn=_as_loaded,  # not default_convert: it would turn tuples into lists, arrays into tensors
            sampler=self._schedule,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=True,
            prefetch_factor=2,
            generator=torch.Generator(),  # the DataLoader's own seed draws leave the trainer's generator alone
        )
        self._batches: Iterator[Any] | None = None
        self._stash: dict[int, Any] = {}

    def follow(self, iterations: Iterable[Iteration]) -> Iterator[Iteration]:
        """Yield ``iterations`` while the workers load their micro-batches ahead; a new loader iterator each call."""
        pending: deque[Iteration] = deque()
        source = iter(iterations)

        def items() -> Iterator[tuple[int, int, list[int]]]:
            for iteration in source:
                pending.append(iteration)
                for mb in iteration.micro_batches:
                    yield mb.position, mb.seed, mb.indices

        self._schedule.items = items()
        self._stash.clear()
        self._batches = iter(self.loader)  # persistent workers: torch drops what was prefetched before
        while pending:
            yield pending.popleft()
            # Taking the iteration's batches has moved the sampler at least one micro-batch on.

    def take(self, mb: MicroBatch) -> tuple[Any, Any]:
        """The batch of ``mb`` on the device; the generators as in-process loading would have left them."""
        batch = self._stash.pop(mb.position, None)
        while batch is None:
            if self._batches is None:
                raise RuntimeError("MicroBatchFeed.take before follow")
            key, loaded, states = next(self._batches)
            if key == mb.position:
                batch = (loaded, states)
            else:
                self._stash[key] = (loaded, states)
        (inputs, target), (torch_state, python_state, numpy_state) = batch
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        return to_device(inputs, self.device), to_device(target, self.device)
