"""Rank 0's step reports: the loss, throughput and iteration time of the steps since the last report.

At most every :data:`LOG_INTERVAL_S` a report goes to the metrics files (``steps.csv``, and each rank's
median busy time to ``busy.csv``, :mod:`jabascli.engine.busy`) and as a ``step`` event to whoever launched
the trainer (the progress bar of ``jabas run``, a worker agent).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Any, Protocol

import torch

from jabascli.engine.busy import rank_medians
from jabascli.engine.checkpoint import Progress
from jabascli.engine.events import EventSink
from jabascli.engine.metrics import EpochResult, MetricsWriter
from jabascli.engine.parallel.runner import describe_layout
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import IIDPSampler

LOG_INTERVAL_S = 0.25


class Loop(Protocol):
    """What the step log reads of the training loop (a :class:`~jabascli.engine.trainer.Trainer`)."""

    rank: int
    emit: EventSink | None
    device: torch.device
    plan: TrainingPlan
    progress: Progress
    sampler: IIDPSampler
    optimizer: torch.optim.Optimizer


class StepLog:
    """Rank 0's step reports: averaged over the steps since the last one, at most every LOG_INTERVAL_S.

    Also the median duration of those steps, each timed from the end of the one before
    (the first of an epoch from the epoch's start).
    """

    def __init__(self, trainer: Loop, metrics: MetricsWriter | None, epoch_steps: int) -> None:
        self.trainer, self.metrics, self.epoch_steps = trainer, metrics, epoch_steps
        self.active = trainer.rank == 0 and (metrics is not None or trainer.emit is not None)
        self.loss = torch.zeros((), dtype=torch.float64, device=trainer.device)
        self.steps = 0
        self.durations: list[float] = []
        self.busy: list[torch.Tensor] = []
        """Every rank's busy times of each step since the last report, on the device until then."""
        self.since = self.last = self.step_end = time.perf_counter()

    def settings(self) -> None:
        """Record the GBS and LR of the iteration about to run (``changes.csv`` keeps only changes)."""
        if self.metrics is not None:
            t = self.trainer
            self.metrics.settings(step=t.progress.step + 1, gbs=t.plan.gbs, lr=current_lr(t.optimizer))

    def step(self, loss: torch.Tensor, busy: torch.Tensor | None = None) -> None:
        """A step ended: its mean loss and, when measured, every rank's busy time (both summed over ranks)."""
        if not self.active:
            return
        now = time.perf_counter()
        self.durations.append(now - self.step_end)
        self.step_end = now
        self.loss += loss
        if busy is not None and self.metrics is not None:
            self.busy.append(busy.clone())  # the next iteration writes over it
        self.steps += 1
        if now - self.last >= LOG_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if not self.active or self.steps == 0:
            return
        t, now = self.trainer, time.perf_counter()
        loss = float(self.loss) / self.steps
        rate = self.steps * t.plan.gbs / max(now - self.since, 1e-9)
        p = t.progress
        epoch_step, lr = p.position // t.plan.gbs, current_lr(t.optimizer)
        self.epoch_steps = epoch_step + t.sampler.iterations_left(p.position, t.plan.gbs)  # the GBS may change
        if self.metrics is not None:
            iteration_s = statistics.median(self.durations)
            self.metrics.step(
                epoch=p.epoch,
                step=p.step,
                gbs=t.plan.gbs,
                loss=loss,
                samples_per_s=rate,
                lr=lr,
                iteration_s=iteration_s,
            )
            busy = rank_medians(self.busy)
            if busy:
                self.metrics.busy(step=p.step, busy_s=busy)
        if t.emit:
            event = {"event": "step", "epoch": p.epoch, "step": p.step, "epoch_step": epoch_step}
            event.update(epoch_steps=self.epoch_steps, gbs=t.plan.gbs, loss=loss, samples_per_s=rate, lr=lr)
            t.emit(event)
        self.loss.zero_()
        self.steps = 0
        self.durations, self.busy = [], []
        self.since = self.last = now

    def adjustment(self, event: dict[str, Any]) -> None:
        """An adaptive-batching decision (rank 0's): to ``adjustments.csv`` and as an event, with the LR it set."""
        lr = current_lr(self.trainer.optimizer)
        if self.metrics is not None:
            self.metrics.adjustment({k: v for k, v in event.items() if k != "event"}, lr=lr)
        if self.trainer.emit:
            self.trainer.emit({**event, "lr": lr})

    def epoch_end(self, result: EpochResult) -> None:
        """The epoch's row of ``epochs.csv`` and its ``epoch`` event."""
        if self.metrics is not None:
            self.metrics.epoch(asdict(result))
        if self.trainer.emit:
            self.trainer.emit({"event": "epoch", **asdict(result)})


def current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """The LR of the optimizer's first parameter group (what the metrics report)."""
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, int | float | torch.Tensor) else None


def report_start(trainer: Any) -> None:
    """Rank 0's ``start`` event: the plan, how it runs, and where training stands (a :class:`Trainer`'s)."""
    if not trainer.emit:
        return
    p, plan = trainer.progress, trainer.plan
    trainer.emit(
        {
            "event": "start",
            "pid": os.getpid(),
            "job": trainer.loaded.config.job.name,
            "world_size": plan.world_size,
            "gbs": plan.gbs,
            "lbs": plan.lbs,
            "workers": plan.workers,
            "plan": plan.describe(),
            "weight_sync": trainer.workers.weight_sync,
            "weight_sync_reason": trainer.workers.weight_sync_reason,
            "vsw_strategy": trainer.workers.vsw_name,
            "layout": describe_layout(trainer.layout),
            "replicas": None
            if trainer.layout is None
            else plan.replica_micro_batches(trainer.layout.tp * trainer.layout.pp),
            "loader_workers": 0 if trainer.feed is None else trainer.feed.workers,
            "precision": trainer.step_policy.settings.precision,
            "device": str(trainer.device),
            "epochs": trainer.epochs,
            "steps_per_epoch": trainer.sampler.iterations_per_epoch(plan.gbs),
            "epoch": p.epoch,
            "position": p.position,
            "step": p.step,
        }
    )
