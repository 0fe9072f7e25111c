"""A job's progress as its trainers report it: the epoch, the completed steps, the loss, the GBS, each epoch's record.

The trainers' events (``start``, ``step``, ``adjustment``, ``epoch``, ``checkpoint``, ``done``,
``first_step``) reach the scheduler in their agents' heartbeats; :class:`Progress` keeps what they say.
The move the current generation started with (:class:`~jabascli.elastic.protocol.MoveRecord`) gets its
figures from them too: the step it resumed at, the loss after it, and its downtime, from the last
iteration before it to the first after it::

    downtime_s = first_iteration_at - last_iteration_at

The scheduler (:mod:`jabascli.elastic.job`) decides what the events mean for the job's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jabascli.elastic.protocol import EpochRecord, MoveRecord


@dataclass
class Progress:
    """What the trainers have reported of the job so far (``step``: completed optimizer steps)."""

    epoch: int = 0
    step: int = 0
    gbs: int | None = None
    loss: float | None = None
    initial_loss: float | None = None
    checkpoint_step: int | None = None
    epoch_history: list[EpochRecord] = field(default_factory=list)
    adjusted: list[int] = field(default_factory=list)
    """The GBS after each adjustment point of the current epoch (adaptive jobs' ``adjustment`` events)."""

    def record(self, event: dict[str, Any], servers: list[str], move: MoveRecord | None) -> None:
        """Keep what ``event``, from a generation on ``servers``, says; ``move``: the move that generation
        started with, if any."""
        kind = event.get("event")
        if kind == "start":
            self.gbs = event_int(event, "gbs")
            self.epoch, self.step = event_int(event, "epoch") or 0, event_int(event, "step") or 0
            if move is not None:
                move.resumed_step = self.step
        elif kind == "step":
            self.step = event_int(event, "step") or self.step
            self.gbs = event_int(event, "gbs") or self.gbs  # an adaptive job's GBS moves within a generation
            self.loss = event_float(event, "loss")
            if self.initial_loss is None:
                self.initial_loss = self.loss
            if move is not None and move.loss_after is None:
                move.loss_after = self.loss
        elif kind == "adjustment":
            gbs = event_int(event, "new_gbs")
            if gbs is not None:
                self.gbs = gbs
                self.adjusted.append(gbs)
        elif kind == "epoch":
            self._epoch_ended(event, servers)
        elif kind == "checkpoint":
            self.checkpoint_step = event_int(event, "step")
        elif kind == "done":
            self.step = event_int(event, "step") or self.step
            self.checkpoint_step = self.step  # a checkpoint is written on every exit
        elif kind == "first_step" and move is not None:
            ended, started = event_float(event, "time"), event_float(event, "started")
            move.first_iteration_at = started if started is not None else ended
            if started is not None and ended is not None:
                move.first_iteration_s = ended - started
            if move.first_iteration_at is not None and move.last_iteration_at is not None:
                move.downtime_s = move.first_iteration_at - move.last_iteration_at

    def _epoch_ended(self, event: dict[str, Any], servers: list[str]) -> None:
        self.epoch = (event_int(event, "epoch") or 0) + 1
        self.epoch_history.append(
            EpochRecord(
                epoch=event_int(event, "epoch") or 0,
                step=event_int(event, "step") or 0,
                gbs=self.gbs,
                servers=list(servers),
                train_loss=event_float(event, "train_loss"),
                val_loss=event_float(event, "val_loss"),
                val_accuracy=event_float(event, "val_accuracy"),
                samples_per_s=event_float(event, "samples_per_s") or 0.0,
                time_s=event_float(event, "time_s") or 0.0,
                gbs_history=self.adjusted,
            )
        )
        self.adjusted = []

    def status_fields(self) -> dict[str, Any]:
        """Its part of :class:`~jabascli.elastic.protocol.JobStatus`."""
        return {
            "gbs": self.gbs,
            "epoch": self.epoch,
            "step": self.step,
            "loss": self.loss,
            "initial_loss": self.initial_loss,
            "checkpoint_step": self.checkpoint_step,
            "epoch_history": [e.model_copy() for e in self.epoch_history],
        }


def event_int(event: dict[str, Any], key: str) -> int | None:
    """``event[key]`` if it is an int (events come over the network: anything else is None)."""
    value = event.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def event_float(event: dict[str, Any], key: str) -> float | None:
    """``event[key]`` as a float if it is a number, else None."""
    value = event.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
