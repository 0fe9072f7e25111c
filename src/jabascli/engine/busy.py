"""Each rank's busy time per iteration: how long it computed before it could only wait for the others.

A rank's **busy time** in an iteration runs from the iteration's start to the moment its last gradient bucket
is ready to be all-reduced (after an emulated device's slowdown, :class:`~jabascli.engine.vsw.Emulation`).
Everything after it (the last all-reduce, the wait for slower ranks, the update) the ranks share::

    iteration time  ~=  max over ranks (busy time)  +  exposed all-reduce  +  update

So the iteration time measures only the slowest rank; the busy times measure every rank, at the LBS and
micro-steps the plan gives it. The online performance model fits each server's computation to its ranks'
busy times (:mod:`jabascli.perfmodel.online`), which is how a server that does not set the pace is measured.

The times ride along in the last gradient bucket's all-reduce (:attr:`BusyClock.times`, one slot per rank,
each rank writing only its own before the sum), so every rank ends the iteration knowing all of them, and
rank 0 logs them (``busy.csv``, :mod:`jabascli.engine.metrics`) without a collective of their own.

Measured on the host clock on a CPU. On CUDA the host reaches the last bucket when its kernels are queued,
not done, so the time is taken with CUDA events instead; reading an event's time waits for it, so each
iteration carries its *previous* iteration's busy time, whose events are long complete by then (a slot of 0:
not known yet). A rank whose workers reduce inside backward (a ``[parallel]`` layout) never reaches the mark
and reports nothing.
"""

from __future__ import annotations

import statistics
import time

import torch


class BusyClock:
    """One rank's busy-time clock and the tensor of every rank's busy time (s) that rides along."""

    times: torch.Tensor
    """Slot ``r``: rank ``r``'s busy time in seconds (0: not measured); summed over ranks with the last bucket."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rank = rank
        self.times = torch.zeros(world_size, dtype=dtype, device=device)
        self._events = device.type == "cuda"
        self._started = 0.0
        self._begin: torch.cuda.Event | None = None
        self._marked: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        """CUDA: this iteration's start and mark events, once marked."""
        self._previous: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        """The iteration starts now: clear every slot (the tensor holds the last iteration's sum)."""
        self.times.zero_()
        if self._events:
            self._previous, self._marked = self._marked, None
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._started = time.perf_counter()

    def mark(self) -> None:
        """The rank's last gradient bucket is ready: write its busy time into its slot, before the all-reduce."""
        if not self._events:
            self.times[self.rank].fill_(time.perf_counter() - self._started)
            return
        if self._begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marked = (self._begin, end)
        previous = self._previous
        if previous is not None and previous[1].query():  # recorded an iteration ago: done by now, as a rule
            self.times[self.rank].fill_(previous[0].elapsed_time(previous[1]) / 1e3)


def rank_medians(busy: list[torch.Tensor]) -> dict[int, float]:
    """Each rank's median busy time (s) over the steps given, leaving out the steps it did not measure (0)."""
    if not busy:
        return {}
    table = torch.stack(busy).to("cpu", torch.float64)
    out: dict[int, float] = {}
    for rank in range(table.shape[1]):
        measured = table[:, rank][table[:, rank] > 0]
        if measured.numel():
            out[rank] = statistics.median(measured.tolist())
    return out
