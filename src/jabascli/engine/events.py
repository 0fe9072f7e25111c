"""Progress events from trainers, as JSON lines on a pipe (how ``jabas run`` follows its trainers).

Rank 0 sends ``start``, ``step``, ``epoch``, ``checkpoint`` and ``done`` events;
any rank sends ``error`` before it exits on a failure. The launcher passes the
pipe's write end to every trainer and names it in ``JABAS_EVENT_FD``. Each
event is one ``os.write`` of one line under ``PIPE_BUF`` bytes, so lines from
different ranks never interleave.

=============  ================================================================================
``start``      ``pid, job, world_size, gbs, lbs, workers, plan, weight_sync, weight_sync_reason,
               vsw_strategy, layout (``[parallel]``'s, or null), replicas (each replica's micro-batches under a
               layout, or null), device, epochs, steps_per_epoch, epoch,
               position, step``
``step``       ``epoch, step, epoch_step, epoch_steps, gbs, loss, samples_per_s, lr``
``epoch``      ``epoch, step, train_loss, val_loss, val_accuracy, samples_per_s, time_s``
``checkpoint`` ``path, epoch, position, step``
``done``       ``results`` (the epoch events' fields), ``step``, ``stopped`` (by ``max_steps``)
``error``      ``rank, kind`` (``input`` or ``runtime``), ``message``
=============  ================================================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

EVENT_FD_ENV = "JABAS_EVENT_FD"
MAX_LINE = 4000  # under PIPE_BUF (4096 on Linux): one write is atomic

EventSink = Callable[[dict[str, Any]], None]


class PipeEvents:
    """An :data:`EventSink` writing JSON lines to a file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, default=str)
        if len(line) >= MAX_LINE and "message" in event:
            cut = len(line) - MAX_LINE + 100
            line = json.dumps({**event, "message": str(event["message"])[:-cut] + " ..."}, default=str)
        os.write(self.fd, (line + "\n").encode())


def events_from_environment(environ: Mapping[str, str] | None = None) -> PipeEvents | None:
    value = (os.environ if environ is None else environ).get(EVENT_FD_ENV)
    return PipeEvents(int(value)) if value else None
