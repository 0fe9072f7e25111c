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

A request may also be JSON, ``{"when": "now", "handoff": {...}}``: a move in
place (:mod:`jabascli.engine.handoff`). After the stop, :meth:`StopControl.handoff`
takes the request out of the file (so that the next generation does not stop on
it again) and shares the handoff with every rank.

A stopping trainer finishes as after ``--max-steps``: it writes its checkpoint
and exits 0 with ``stopped`` in its ``done`` event. Rank 0 also reports the wall
time at which it stopped training (``stopping``: its last iteration ended, and at
an epoch end the epoch's validation too, which would have run anyway) and at
which the first iteration of a run began and ended (``first_step``, ``started``
and ``time``), from which the elastic scheduler measures a move's downtime: the
time no iteration ran that would have without the move.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from jabascli.engine.events import EventSink
from jabascli.engine.handoff import Handoff, share
from jabascli.engine.trainer_env import CONTROL_FILE_ENV
from jabascli.errors import InputError

POLL_S = 0.1
"""Rank 0 looks at the control file at most this often between epoch ends."""
REQUESTS = ("epoch", "now")


def read_request(path: Path | None) -> str | None:
    """The request in a control file: ``epoch``, ``now``, or None (no file, or anything else)."""
    return parse_request(_read(path))[0]


def parse_request(text: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """``(when, handoff)`` of a request: plain ``epoch``/``now``, or JSON with ``when`` and ``handoff``."""
    text = (text or "").strip()
    if text in REQUESTS:
        return text, None
    try:
        data = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(data, dict) or data.get("when") not in REQUESTS:
        return None, None
    handoff = data.get("handoff")
    return data["when"], handoff if isinstance(handoff, dict) else None


def _read(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError:
        return None


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
        self._started: float | None = None
        """When the first iteration began (wall clock)."""
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
        if self._started is None:
            self._started = time.time()
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
            self._report("first_step", step, started=self._started)
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
        return self.stop

    def stopped(self, step: int) -> None:
        """Training stops here for a request: where a move's downtime begins (reported by rank 0)."""
        self._report("stopping", step)

    def handoff(self) -> Handoff | None:
        """After a stop, on every rank: the next generation rank 0's request described, if any.

        Rank 0 takes the request out of the control file (renamed, so a request written
        afterwards is never lost) and shares its handoff; a plain stop shares nothing.
        """
        mine = None
        if self.path is not None:
            taken = self.path.with_name(self.path.name + ".taken")
            with contextlib.suppress(OSError):
                os.replace(self.path, taken)
            when, data = parse_request(_read(taken))
            if data is not None:
                with contextlib.suppress(InputError):  # the controller checked it: a plain stop, then
                    mine = Handoff.from_json(data, str(self.path))
            elif when is not None:
                os.replace(taken, self.path)  # a plain stop: leave the request where it was
        return share(mine, self.rank, self.flag.device)

    def _agree(self, requested: bool) -> bool:
        """Rank 0's decision, on every rank (one broadcast; only at epoch ends)."""
        decision = torch.tensor([1.0 if requested else 0.0], dtype=self.flag.dtype, device=self.flag.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(decision, 0)
        return bool(decision.item() > 0)

    def _report(self, event: str, step: int, **more: object) -> None:
        if self.emit is not None:
            self.emit({"event": event, "step": step, "time": time.time(), **more})
