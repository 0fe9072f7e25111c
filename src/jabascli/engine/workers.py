"""How one rank runs its workers and combines their gradients: the one object the training loop calls.

A rank trains its ``VSW x (GA + 1)`` micro-batches of every iteration in one of two ways:

- **plain IIDP**: the rank's VSW strategy (:mod:`jabascli.engine.vsw`; ``sequential``: the VSWs'
  micro-batches one after another on one model, ``streams``: one model replica per VSW) over DDP,
  whose communication hook (:class:`jabascli.engine.weight_sync.GradientSync`) adds the replicas'
  gradients into replica 0's buckets and all-reduces them (and, with ``overlap`` weight sync,
  updates each bucket once its all-reduce completed);
- **a [parallel] layout**: the layout's workers (:class:`jabascli.engine.parallel.runner.LayoutWorkers`),
  which run every micro-batch of the rank's replica and reduce the gradients inside backward.

Both answer :class:`Workers` (the loop) and :class:`GradientCombiner` (a plan's start);
:class:`RankWorkers` holds the one chosen, with how and why it was chosen (the ``start`` event).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jabascli.config import LoadedConfig
from jabascli.engine.buffers import BufferSync
from jabascli.engine.busy import BusyClock
from jabascli.engine.distributed import wrap_ddp
from jabascli.engine.faults import FaultInjector
from jabascli.engine.parallel.runner import FALLBACK, LayoutWorkers
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.recovery import undo_log
from jabascli.engine.sampler import MicroBatch
from jabascli.engine.step_policy import StepPolicy
from jabascli.engine.vsw import Emulation, WorkerStep, build_vsw_strategy, choose_vsw_strategy, make_replicas
from jabascli.engine.weight_sync import (
    BucketOptimizer,
    GradientSync,
    bucket_sizes,
    choose_weight_sync,
)
from jabascli.profiles.formats import profiled_bucket_sizes
from jabascli.workload import Workload


class Workers(Protocol):
    """What the training loop and validation ask of a rank's workers."""

    replicas: list[nn.Module]
    keeps_gradients: bool
    """Replica 0's gradients live on from one iteration to the next (the emulated memory limit counts them)."""

    def run(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None: ...
    def zero_grad(self) -> None: ...
    def after_step(self) -> None: ...
    def replica_params(self) -> list[list[nn.Parameter]]: ...
    def share(self, plan: TrainingPlan, rank: int) -> tuple[int, int]: ...
    def evaluating(self) -> contextlib.AbstractContextManager[None]: ...
    def forward(self, inputs: Any) -> Any: ...


class GradientCombiner(Protocol):
    """Where the gradients of a plan's workers are added up (and the buffers' sums ride along)."""

    def attach(self, vsw: Workers, buffers: BufferSync, plan: TrainingPlan) -> None: ...


@dataclass
class RankWorkers:
    """A rank's workers, how its gradients are combined, and the choices behind them."""

    workers: Workers
    gradients: GradientCombiner
    weight_sync: str
    """``sequential`` (one optimizer step after the all-reduce) or ``overlap`` (per bucket)."""
    weight_sync_reason: str
    vsw_name: str
    vsw_reason: str
    replica_ranks: list[int]
    """The ranks whose micro-batches this rank runs: itself, or every rank of its layout's replica."""
    ddp: DistributedDataParallel | None = None
    """Plain IIDP's DDP over replica 0 (None under a layout)."""

    def start(self, plan: TrainingPlan, riders: list[torch.Tensor] | None = None) -> BufferSync:
        """The running statistics' and loss's sums for ``plan``, which starts now, attached to the gradients'
        all-reduce; ``riders``: tensors that ride along in it (the stop flag, :mod:`jabascli.engine.control`)."""
        buffers = BufferSync(self.workers.replicas, plan.workers)
        buffers.riders = riders if riders is not None else buffers.riders
        self.gradients.attach(self.workers, buffers, plan)
        return buffers

    def follow(self, plan: TrainingPlan, rank: int, model: nn.Module, riders: list[torch.Tensor]) -> BufferSync:
        """A new plan of the same ranks: ``streams`` makes as many replicas as the rank's new VSW count
        (from replica 0, so with its parameters and statistics); the other strategies keep theirs. The new
        plan's sums, as :meth:`start`."""
        vsw = plan.rank(rank).vsw
        if self.vsw_name == "streams" and self.ddp is not None and len(self.workers.replicas) != vsw:
            self.workers = build_vsw_strategy(self.vsw_name, make_replicas(model, vsw), self.ddp)
            self.workers.after_step()
        return self.start(plan, riders)


class WorkerInputs(Protocol):
    """What building a rank's workers reads of its trainer (a :class:`~jabascli.engine.trainer.Trainer`)."""

    loaded: LoadedConfig
    plan: TrainingPlan
    rank: int
    model: nn.Module
    device: torch.device
    workload: Workload
    step_policy: StepPolicy
    emulation: Emulation
    busy: BusyClock
    options: Any
    """:class:`~jabascli.engine.options.TrainOptions` (``bucket_cap_mb``)."""
    adaptive: Any
    """Adaptive batching's hook (:mod:`jabascli.adaptive.batching`; ``tap``)."""
    layout_workers: LayoutWorkers | None
    faults: FaultInjector


def rank_workers(trainer: WorkerInputs, same_start: bool) -> RankWorkers:
    """The trainer's workers: its layout's when it has one, else plain IIDP's (:func:`plain_workers`).

    ``same_start``: every rank has just loaded its parameters from one checkpoint (DDP need not broadcast
    rank 0's).
    """
    if trainer.layout_workers is not None:
        trainer.layout_workers.emulate(trainer.emulation, trainer.workload)
        layout = trainer.layout_workers
        return RankWorkers(layout, layout, "sequential", FALLBACK, "sequential", FALLBACK, layout.ranks)
    return plain_workers(trainer, same_start)


def plain_workers(trainer: WorkerInputs, same_start: bool) -> RankWorkers:
    """Plain IIDP: VSW replicas of the model, DDP over replica 0 and its communication hook (which hands
    replica 0's own gradients to adaptive batching's ``tap`` before it adds them up)."""
    loaded, plan, model, device, policy = (
        trainer.loaded,
        trainer.plan,
        trainer.model,
        trainer.device,
        trainer.step_policy,
    )
    cap_mb = trainer.options.bucket_cap_mb
    weight_sync, weight_sync_reason = choose_weight_sync(
        plan,
        policy.optimizer,
        forced=policy.settings.sequential_reason(),
        configured=loaded.config.job.weight_sync,
        where=loaded.path,
        buckets_mb=lambda: (
            profiled_bucket_sizes(loaded.profile_dirs().bucket, trainer.workload.name)
            or [size / 1e6 for size in bucket_sizes(model, cap_mb)]
        ),
    )
    vsw = plan.rank(trainer.rank).vsw
    vsw_name, vsw_reason = choose_vsw_strategy(loaded.config.job.vsw_strategy, vsw, model, device)
    replicas = make_replicas(model, vsw if vsw_name == "streams" else 1)
    ddp = wrap_ddp(model, device, cap_mb, same_start=same_start)
    emulation = trainer.emulation
    gradients = GradientSync(
        list(model.parameters()),
        optimizer=BucketOptimizer(policy.optimizer, undo_log(loaded)) if weight_sync == "overlap" else None,
        before_last_bucket=_in_turn(emulation.backward_done if emulation.active else None, trainer.busy.mark),
        tap=trainer.adaptive.tap,
        after_update=trainer.faults.after_bucket_update if trainer.faults.in_updates else None,
    )
    gradients.register(ddp)
    workers = build_vsw_strategy(vsw_name, replicas, ddp)
    ranks = [trainer.rank]
    return RankWorkers(workers, gradients, weight_sync, weight_sync_reason, vsw_name, vsw_reason, ranks, ddp)


def _in_turn(*calls: Callable[[], None] | None) -> Callable[[], None]:
    """One callable that makes the given calls in order (None: left out)."""
    kept = [c for c in calls if c is not None]

    def call() -> None:
        for c in kept:
            c()

    return call
