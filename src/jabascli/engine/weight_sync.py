"""Weight synchronisation: one all-reduce per gradient bucket, then the optimizer.

Gradients are reduced by a DDP communication hook on replica 0 of every rank:

1. ``streams`` VSW strategy: the other replicas' gradients of the bucket's
   parameters are first added into the bucket (local aggregation, so there is
   still one all-reduce per bucket per rank);
2. the bucket is SUM-all-reduced. Every worker's loss was scaled by
   ``1 / (GBS / LBS)``, so the sum is exactly the mean over all workers, however
   unevenly they are spread over ranks;
3. ``overlap`` only: as soon as a bucket's all-reduce completes, the optimizer is
   applied to that bucket's parameters (:class:`BucketOptimizer`), while backward
   and the other buckets' all-reduces go on. ``sequential`` steps the optimizer
   once, after backward.

The last bucket's all-reduce also carries the rank's BatchNorm statistics terms
and loss (``riders``, from :meth:`~jabascli.engine.buffers.BufferSync.take_riders`):
one collective per bucket and none besides, which is what the performance model
counts. (As a collective of its own, started before the last backward, that sum
measurably delayed the bucket all-reduces queued behind it on gloo.)

Methods: ``sequential``, ``overlap``, and ``recommend`` (:func:`recommend_weight_sync`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from jabascli.engine.bucket_undo import UndoLog
from jabascli.engine.buffers import BufferSync
from jabascli.engine.options import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB
from jabascli.errors import InputError

# Optimizers whose step updates every parameter from its own gradient and state
# alone, so stepping a subset of parameters equals their part of a full step.
# (Exact classes only: a subclass may couple parameters.)
PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "Adafactor",
    )
    if hasattr(torch.optim, name)
)


def supports_overlap(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in PER_PARAMETER_OPTIMIZERS


class BucketOptimizer:
    """Applies an optimizer to some of its parameters, exactly as its full ``step()`` would update them.

    Uses only public optimizer API: the ``params`` lists of ``param_groups`` are
    narrowed to the bucket's parameters for the duration of one ``step()`` and
    restored. So there is one optimizer (one ``state_dict``, one LR scheduler),
    and hyper-parameters are read from the groups as usual. Calls come from the
    communication threads, one at a time (a lock).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, undo: UndoLog | None = None) -> None:
        if not supports_overlap(optimizer):
            raise ValueError(f"{type(optimizer).__name__} cannot be applied per bucket")
        self.optimizer = optimizer
        self._group = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._lock = threading.Lock()
        self.applied = 0
        """Bucket updates applied so far (engine/recovery.py: did a failed iteration change anything?)."""
        self.undo = undo
        """Where a job recovers in place: what each update overwrites, to take an interrupted iteration back."""

    def step(self, params: Sequence[torch.Tensor]) -> None:
        groups = self.optimizer.param_groups
        subsets: list[list[torch.Tensor]] = [[] for _ in groups]
        for p in params:
            i = self._group.get(p)
            if i is not None:
                subsets[i].append(p)
        with self._lock:
            if self.undo is not None and not self.undo.save([p for ps in subsets for p in ps], self.optimizer.state):
                return  # the iteration was taken back: a late all-reduce changes nothing
            saved = [g["params"] for g in groups]
            try:
                for g, subset in zip(groups, subsets, strict=True):
                    g["params"] = subset
                self.optimizer.param_groups = [g for g, subset in zip(groups, subsets, strict=True) if subset]
                self.applied += 1
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups
                for g, params_ in zip(groups, saved, strict=True):
                    g["params"] = params_


class GradientSync:
    """The DDP communication hook of replica 0 (see the module docstring).

    ``replicas``: the parameters of the other VSW replicas (``streams``), in the
    order of replica 0's ``parameters()``. ``before_last_bucket`` runs once all
    gradients of the iteration are computed, just before the last bucket's
    all-reduce (emulated slowdown uses it). ``riders(dtype)`` gives tensors to
    SUM-all-reduce in place together with the last bucket (only those of the
    bucket's dtype are asked for). ``tap(params)`` sees replica 0's gradients of
    each bucket before anything is added or reduced (adaptive batching's
    first-half measurement). ``after_update`` runs after each bucket's update
    (``overlap``; a fault injected for tests, engine/faults.py).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        replicas: Sequence[Sequence[nn.Parameter]] = (),
        optimizer: BucketOptimizer | None = None,
        before_last_bucket: Callable[[], None] | None = None,
        riders: Callable[[torch.dtype], list[torch.Tensor]] | None = None,
        tap: Callable[[Sequence[torch.Tensor]], None] | None = None,
        group: dist.ProcessGroup | None = None,
        after_update: Callable[[], None] | None = None,
    ) -> None:
        self._index = {p: i for i, p in enumerate(params)}
        self.replicas = [list(r) for r in replicas]
        self.optimizer = optimizer
        self.before_last_bucket = before_last_bucket
        self.riders = riders
        self.tap = tap
        self.group = group
        self.after_update = after_update

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(None, self.hook)

    def attach(self, vsw: Any, buffers: BufferSync, plan: Any) -> None:
        """For the VSWs of the plan that starts now: add their replicas' gradients, and carry the buffers' sums on
        the last bucket (``plan``: unused here; a layout's workers, called the same way, need it)."""
        self.replicas = [list(r) for r in vsw.replica_params()]
        self.riders = buffers.take_riders
        buffers.carried = True

    # Unannotated on purpose: DDP checks the annotations' values, and this module's are strings.
    def hook(self, state, bucket):  # (object, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
        params = bucket.parameters()
        if self.replicas or self.optimizer is not None:
            _check_views(params, bucket.buffer())
        if self.tap is not None:
            self.tap(params)  # replica 0's own gradients, before aggregation and all-reduce
        if self.replicas:
            grads = [p.grad for p in params]
            for replica in self.replicas:
                theirs = [replica[self._index[p]].grad for p in params]
                pairs = [(g, t) for g, t in zip(grads, theirs, strict=True) if t is not None]
                if pairs:
                    torch._foreach_add_([g for g, _ in pairs], [t for _, t in pairs])
        buffer = bucket.buffer()
        riders: list[torch.Tensor] = []
        if bucket.is_last():
            if self.before_last_bucket is not None:
                self.before_last_bucket()
            if self.riders is not None:
                riders = self.riders(buffer.dtype)
        if riders:
            flat = torch.cat([buffer.reshape(-1), *(t.reshape(-1) for t in riders)])
            future = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
        else:
            future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        optimizer = self.optimizer

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()  # raises when the all-reduce failed (a lost peer): no update from it
            if riders:
                _unflatten(reduced[0], [buffer, *riders])
            if optimizer is not None:
                optimizer.step(params)
                if self.after_update is not None:
                    self.after_update()
            return buffer

        return future.then(done)


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _check_views(params: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
    """Replica 0's ``.grad`` must alias the bucket (``gradient_as_bucket_view``): both uses above rely on it."""
    storage = buffer.untyped_storage().data_ptr()
    for p in params:
        if p.grad is None or p.grad.untyped_storage().data_ptr() != storage:
            raise RuntimeError(
                "a gradient is not a view into its DDP bucket; local VSW aggregation and per-bucket optimizer "
                "steps need DistributedDataParallel(gradient_as_bucket_view=True)"
            )


@dataclass(frozen=True)
class WeightSyncChoice:
    method: str
    reason: str


def bucket_sizes(model: nn.Module, cap_mb: float | None = None) -> list[int]:
    """DDP's gradient buckets of a model in bytes, as it builds them once gradient order is known.

    Parameters in reverse order (gradients are ready roughly back to front),
    a new bucket whenever one reaches ``cap_mb`` MiB. ``cap_mb`` None is DDP's
    default: 25 MiB, with a first bucket of 1 MiB.
    """
    sizes: list[int] = []
    first = DEFAULT_FIRST_BUCKET_MB if cap_mb is None else cap_mb
    rest = DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb
    current = 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        current += p.numel() * p.element_size()
        if current >= (rest if sizes else first) * 2**20:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return sizes


def recommend_weight_sync(
    buckets: Sequence[float], world_size: int, optimizer: torch.optim.Optimizer
) -> WeightSyncChoice:
    """The ``recommend`` rule.

    ``overlap`` when it can hide work: the optimizer can be applied per bucket,
    there is more than one rank, and the gradients form at least two buckets
    (then every bucket's update but the last runs while later buckets are still
    being computed or reduced). Otherwise ``sequential``: with one bucket the
    update would wait for the only all-reduce anyway and per-bucket application
    only adds overhead.
    """
    if not supports_overlap(optimizer):
        return WeightSyncChoice("sequential", f"{type(optimizer).__name__} cannot be applied per bucket")
    if world_size == 1:
        return WeightSyncChoice("sequential", "one rank: no all-reduce to overlap with")
    if len(buckets) < 2:
        return WeightSyncChoice("sequential", "one gradient bucket: nothing to overlap")
    return WeightSyncChoice("overlap", f"{len(buckets)} gradient buckets: updates overlap later all-reduces")


def choose_weight_sync(
    plan: Any,
    optimizer: torch.optim.Optimizer,
    *,
    forced: str | None,
    configured: str,
    where: Path | None,
    buckets_mb: Callable[[], list[float]],
) -> tuple[str, str]:
    """The weight sync a plain IIDP trainer runs, and why: the plan's (``recommend``: :func:`recommend_weight_sync`
    over the bucket sizes ``buckets_mb`` gives, the profile's or the model's own), unless ``forced`` names why it
    must be sequential (mixed precision's loss scaling, gradient clipping). ``configured``: ``[job] weight_sync``;
    ``where``: the config, named in errors.
    """
    requested = plan.weight_sync
    if forced is not None:
        return "sequential", forced if requested != "overlap" else f"overlap asked for, but {forced}"
    if requested == "overlap" and not supports_overlap(optimizer):
        name = type(optimizer).__name__
        raise InputError.at(
            where,
            "job.weight_sync",
            f"overlap applies the optimizer per gradient bucket, which {name} does not allow "
            "(it needs an optimizer that updates each parameter on its own: SGD, Adam, AdamW ...)",
        )
    if requested != "recommend":
        if not plan.from_plan_file or configured == requested:
            return requested, "set in [job] weight_sync"  # which wins over a plan file's (engine/plan.py)
        source = plan.file
        return requested, f"from the plan in {source}" if os.path.isfile(source) else f"from the {source} plan"
    choice = recommend_weight_sync(buckets_mb(), plan.world_size, optimizer)
    return choice.method, f"recommended: {choice.reason}"
