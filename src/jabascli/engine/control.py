"""Stopping a job early at the same iteration on every rank: the hook an outside controller steers.

Whoever steers a job (the worker agent of ``jabas worker``, a test) writes a
*stop request* into the file named by ``JABAS_CONTROL_FILE`` in rank 0's
environment: ``epoch`` (stop at the next epoch end) or ``now`` (stop at the next
iteration boundary). Only rank 0 reads it; every rank must stop after the same
iteration, or the others would wait forever in the next collective. So:

* ``epoch``: at every epoch end (an iteration every rank knows, from the
  sampler) rank 0 reads the file and broadcasts its decision: one collective
  of one number per epoch, nothing per iteration;
* ``now``: rank 0 checks the file at most every :data:`POLL_S` and puts a flag
  into a tensor that rides along with every iteration's all-reduce of the loss
  and running statistics (:attr:`BufferSync.riders`), so it costs no collective.
  Every rank copies the summed flag of iteration ``i`` to the host without
  waiting and reads it at the end of iteration ``i + 1``, by when the copy is
  long done; all ranks therefore stop after iteration ``i + 1``.

A stopping trainer finishes as after ``--max-steps``: it writes its checkpoint
and exits 0 with ``stopped`` in its ``done`` event. Rank 0 also reports the wall
time of its last iteration (``stopping``) and of the first one of a run
(``first_step``), from which the elastic scheduler measures a move's downtime.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from jabascli.engine.events import EventSink

CONTROL_FILE_ENV = "JABAS_CONTROL_FILE"
POLL_S = 0.1
"""Rank 0 looks at the control file at most this often between epoch ends."""
REQUESTS = ("epoch", "now")


def read_request(path: Path | None) -> str | None:
    """The request in a control file: ``epoch``, ``now``, or None (no file, or anything else)."""
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if text in REQUESTS else None


class StopControl:
    """Decides, identically on every rank, whether training stops after the current iteration."""

    def __init__(
        self,
        path: Path | None,
        rank: int,
        flag: torch.Tensor,
        emit: EventSink | None = None,
    ) -> None:
        self.path, self.rank, self.emit = path, rank, emit
        self.flag = flag
        """One number all-reduced (summed) with every iteration's statistics; rank 0's ``now`` sets it."""
        pinned = flag.device.type == "cuda"
        self._host = [torch.zeros_like(flag, device="cpu", pin_memory=pinned) for _ in range(2)]
        self._copies = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._copied = False
        self._slot = 0
        self._polled = 0.0
        self._first = True
        self._now = False
        self.stop = False

    @classmethod
    def from_environment(
        cls,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        emit: EventSink | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> StopControl:
        value = (os.environ if environ is None else environ).get(CONTROL_FILE_ENV)
        path = Path(value) if value and rank == 0 else None
        return cls(path, rank, torch.zeros(1, dtype=dtype, device=device), emit)

    def before_iteration(self) -> None:
        """Set this iteration's flag: rank 0's ``now`` request, 0 elsewhere (the sum is the decision)."""
        if self.path is not None:
            clock = time.monotonic()
            if clock - self._polled >= POLL_S:
                self._polled = clock
                self._now = read_request(self.path) == "now"
        self.flag.fill_(1.0 if self._now else 0.0)

    def after_iteration(self, step: int, epoch_end: bool) -> bool:
        """Called by every rank after every iteration; True when training stops here."""
        if self._first:
            self._first = False
            self._report("first_step", step)
        if epoch_end:
            self.stop = self._agree(read_request(self.path) is not None)
        elif self._copied:
            # The previous iteration's flag, summed over ranks: its copy finished long ago.
            copied = self._copies[1 - self._slot]
            if copied is not None:
                copied.synchronize()
            self.stop = bool(self._host[1 - self._slot].item() > 0)
        self._host[self._slot].copy_(self.flag, non_blocking=True)
        event = self._copies[self._slot]
        if event is not None:
            event.record()
        self._copied = True
        self._slot = 1 - self._slot
        if self.stop:
            self._report("stopping", step)
        return self.stop

    def _agree(self, requested: bool) -> bool:
        """Rank 0's decision, on every rank (one broadcast; only at epoch ends)."""
        decision = torch.tensor([1.0 if requested else 0.0], dtype=self.flag.dtype, device=self.flag.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(decision, 0)
        return bool(decision.item() > 0)

    def _report(self, event: str, step: int) -> None:
        if self.emit is not None:
            self.emit({"event": event, "step": step, "time": time.time()})
