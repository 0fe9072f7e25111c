"""Module buffers across VSWs and ranks: BatchNorm running statistics made exact.

The rule (see docs/engine.md, "BatchNorm and buffers"):

* In training mode every micro-batch is normalised with its own batch
  statistics, as in a single process feeding the GBS samples in micro-batches
  of LBS. Nothing here changes the forward pass, so gradients are exact.
* Running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``
  of every ``BatchNorm*``/``InstanceNorm*`` layer that tracks them) end every
  iteration equal, on every rank and replica, to those of that single process,
  which updates them once per micro-batch in worker order. The update
  ``r <- (1 - f_k) r + f_k s_k`` (``f_k`` the momentum, or ``1 / (n0 + k + 1)``
  for ``momentum=None``) is affine, so after the ``W`` workers of an iteration::

      r = r0 * prod_k (1 - f_k) + sum_k f_k s_k * prod_{j > k} (1 - f_j)

  Each worker's term ``f_k s_k`` is what the layer writes into a zeroed buffer;
  a rank weights its workers' terms by their global index, one all-reduce sums
  them, and every rank adds ``r0 * prod (1 - f_k)``. The statistics, and
  therefore evaluation, do not depend on how the GBS was split across devices.
  In training, the terms (and the loss) ride along with the last gradient
  bucket's all-reduce (:meth:`BufferSync.take_riders`, called by the
  communication hook), so an iteration has no collective of its own for them.
* Every other buffer takes the value of rank 0's replica 0 at the end of each
  iteration (one broadcast per dtype), as DDP broadcasts rank 0's buffers at
  the start of each forward.

Assumes each normalisation layer runs once per forward (a layer applied twice
in one forward updates its statistics twice per micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from jabascli.errors import InputError

try:  # every BatchNorm*/InstanceNorm* layer; private name, stable since torch 1.x
    from torch.nn.modules.batchnorm import _NormBase as _Norm
except ImportError:  # pragma: no cover
    from torch.nn.modules.batchnorm import _BatchNorm as _Norm


def norm_layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for m in model.modules() if isinstance(m, _Norm)]
    for m in layers:
        if isinstance(m, nn.SyncBatchNorm):
            raise InputError.at(
                None,
                "model",
                "SyncBatchNorm normalises over all ranks in every forward, which cannot run with per-rank "
                "VSW/GA counts; use BatchNorm (jabas keeps its running statistics exact, see docs/engine.md)",
            )
    return layers


class BufferSync:
    """Keeps the buffers of a model's VSW replicas exact and identical across ranks.

    Per iteration: :meth:`begin`, then :meth:`before_micro_step` /
    :meth:`after_micro_step` around every worker's forward on its replica,
    :meth:`launch` once the rank's forwards are done, and :meth:`end_iteration`.
    """

    def __init__(self, replicas: Sequence[nn.Module], workers: int, group: dist.ProcessGroup | None = None) -> None:
        self.replicas = list(replicas)
        self.workers = workers
        self.group = group
        self._norms = [norm_layers(r) for r in self.replicas]
        in_norms = {id(b) for m in self._norms[0] for b in m.buffers(recurse=False)}
        other = [name for name, b in self.replicas[0].named_buffers() if id(b) not in in_norms]
        self._other = [[dict(r.named_buffers())[name] for name in other] for r in self.replicas]
        self._groups: list[_Group] = []
        self._kept: list[_Group] = []
        """The last finished iteration's groups, for :meth:`begin` to reuse."""
        self._pending: _PendingSum | None = None
        self.riders: list[torch.Tensor] = []
        """More tensors summed over ranks with every iteration's statistics (e.g. a stop flag,
        :mod:`jabascli.engine.control`): they ride along for free."""
        self.carried = False
        """Set when a communication hook takes the sum along with the last gradient bucket
        (:meth:`take_riders`); otherwise :meth:`launch` starts an all-reduce of its own."""

    # -- per iteration -------------------------------------------------------------------------

    def begin(self) -> None:
        """Snapshot the statistics all workers of this iteration start from.

        The groups of the last iteration are reused when the layers group as they did (the usual case):
        refreshing them is a handful of multi-tensor operations, where building them anew allocates and
        fills every layer's tensors, several hundred operators per iteration on a ResNet-50 (each a kernel
        launch on a GPU).
        """
        groups: dict[tuple[float, int], list[int]] = {}
        for i, m in enumerate(self._norms[0]):
            if m.training and m.track_running_stats and m.running_mean is not None:
                # momentum None: cumulative average, f = 1 / num_batches_tracked (a host read, rare)
                key = (-1.0, int(m.num_batches_tracked)) if m.momentum is None else (float(m.momentum), 0)
                groups.setdefault(key, []).append(i)
        if [(g.key, g.indices) for g in self._kept] == list(groups.items()):
            for g in self._kept:
                g.restart()
            self._groups = self._kept
        else:
            self._groups = [_Group(key, idx, self._norms, self.workers) for key, idx in groups.items()]
        self._kept = []

    def before_micro_step(self, replica: int, worker: int) -> None:
        """Zero the replica's running statistics, so that its layers write ``f_k s_k`` into them."""
        for g in self._groups:
            torch._foreach_zero_(g.stats[replica])
            if g.cumulative:  # the layer's factor is 1 / (num_batches_tracked + 1)
                for m in g.layers[replica]:
                    m.num_batches_tracked.fill_(g.n0 + worker)

    def after_micro_step(self, replica: int, worker: int) -> None:
        """Add worker ``worker``'s term, weighted by the decay of the workers after it."""
        for g in self._groups:
            torch._foreach_add_(g.acc[replica], g.stats[replica], alpha=g.weights[worker])

    def abandon(self) -> None:
        """Give up the iteration under way (a collective failed): every replica's running statistics go back
        to where the iteration started, as if it had not run."""
        for g in self._groups:
            g.write_start()
        self._groups, self._pending = [], None

    def launch(self, extra: torch.Tensor | None = None) -> None:
        """Make the terms ready to be summed over ranks (with ``extra``, e.g. the loss), without waiting.

        Called once all of the rank's forwards are done, just before its last
        backward. With :attr:`carried`, the communication hook takes them into
        the last gradient bucket's all-reduce; otherwise their own all-reduce
        starts now, overlapping the backward.
        """
        for g in self._groups:
            for acc in g.acc[1:]:
                torch._foreach_add_(g.acc[0], acc)
        tensors = [t for g in self._groups for t in g.acc[0]]
        if extra is not None:
            tensors.append(extra)
        self._pending = _PendingSum([*tensors, *self.riders], self.group)
        if not self.carried:
            self._pending.start()

    def take_riders(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The launched tensors of ``dtype``, for the caller to SUM-all-reduce in place (the others start now).

        The communication hook calls this for the last gradient bucket of the
        rank's synchronising backward and all-reduces them with it; DDP waits for
        that before the backward returns. Nothing when nothing was launched, or on
        one rank.
        """
        if self._pending is None:
            return []
        return self._pending.take(dtype)

    def end_iteration(self, extra: torch.Tensor | None = None) -> None:
        """Finish the sum (launching it first if :meth:`launch` was not called) and write the buffers.

        ``extra``, given here or to :meth:`launch`, is summed over ranks in place.
        """
        if self._pending is None:
            self.launch(extra)
        assert self._pending is not None
        self._pending.wait()
        self._pending = None
        for g in self._groups:
            torch._foreach_mul_(g.start_stats, g.total_decay)
            torch._foreach_add_(g.start_stats, g.acc[0])
            torch._foreach_add_(g.start_counts, self.workers)
            g.write_start()
        self._kept, self._groups = self._groups, []
        self._broadcast(self._other)

    # -- whole model ---------------------------------------------------------------------------

    def broadcast_all(self) -> None:
        """Make every buffer equal to rank 0's replica 0, on every rank and replica."""
        self._broadcast([list(r.buffers()) for r in self.replicas])

    def _broadcast(self, per_replica: list[list[torch.Tensor]]) -> None:
        source = per_replica[0]
        if not source:
            return
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            for tensors in _by_dtype(source):  # one broadcast per dtype, as DDP coalesces them
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, root, group=self.group)
                _unflatten(flat, tensors)
        for replica in per_replica[1:]:
            for dst, src in zip(replica, source, strict=True):
                dst.copy_(src)


class _Group:
    """Normalisation layers that share one update factor sequence in an iteration."""

    def __init__(self, key: tuple[float, int], indices: list[int], norms: list[list[nn.Module]], workers: int) -> None:
        self.key, self.indices = key, indices
        momentum, self.n0 = key
        self.cumulative = momentum < 0
        factors = [1.0 / (self.n0 + k + 1) if self.cumulative else momentum for k in range(workers)]
        # weights[k] = prod_{j > k} (1 - f_j); total_decay = prod_j (1 - f_j)
        self.weights = [1.0] * workers
        for k in range(workers - 2, -1, -1):
            self.weights[k] = self.weights[k + 1] * (1 - factors[k + 1])
        self.total_decay = self.weights[0] * (1 - factors[0])
        self.layers = [[replica[i] for i in indices] for replica in norms]
        self.stats = [[t for m in layers for t in (m.running_mean, m.running_var)] for layers in self.layers]
        self.counts = [[m.num_batches_tracked for m in layers] for layers in self.layers]
        self.start_stats = [t.clone() for t in self.stats[0]]
        self.start_counts = [t.clone() for t in self.counts[0]]
        self.acc = [[torch.zeros_like(t) for t in stats] for stats in self.stats]
        self._every_acc = [t for acc in self.acc for t in acc]

    def restart(self) -> None:
        """Start a new iteration from replica 0's statistics as they are now, with nothing accumulated."""
        torch._foreach_copy_(self.start_stats, self.stats[0])
        torch._foreach_copy_(self.start_counts, self.counts[0])
        torch._foreach_zero_(self._every_acc)

    def write_start(self) -> None:
        """Every replica's statistics and counts set to the start (as updated by the iteration, if it was)."""
        for stats, counts in zip(self.stats, self.counts, strict=True):
            torch._foreach_copy_(stats, self.start_stats)
            torch._foreach_copy_(counts, self.start_counts)


class _PendingSum:
    """Tensors to SUM-all-reduce in place: started on their own (:meth:`start`), or taken, by dtype, by a
    caller that all-reduces them with something else (:meth:`take`)."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.tensors, self.group = tensors, group
        self._started: AsyncSum | None = None
        self._taken = False

    def start(self) -> None:
        if self._started is None and not self._taken:
            self._started = AsyncSum(self.tensors, self.group)

    def take(self, dtype: torch.dtype) -> list[torch.Tensor]:
        if self._started is not None or self._taken:
            return []
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return []
        self._taken = True
        riders = [t for t in self.tensors if t.dtype == dtype]
        self._started = AsyncSum([t for t in self.tensors if t.dtype != dtype], self.group)
        return riders

    def wait(self) -> None:
        self.start()
        if self._started is not None:
            self._started.wait()


class AsyncSum:
    """SUM-all-reduce tensors in place, one collective per dtype (flattened), without waiting."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        self._parts: list[tuple[torch.Tensor, list[torch.Tensor], Any]] = []
        if not tensors or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        for same in _by_dtype(tensors):
            flat = torch.cat([t.reshape(-1) for t in same])
            self._parts.append((flat, same, dist.all_reduce(flat, group=group, async_op=True)))

    def wait(self) -> None:
        for flat, tensors, work in self._parts:
            work.wait()
            _unflatten(flat, tensors)
        self._parts = []


def allreduce_sum(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """SUM-all-reduce tensors in place with one collective per dtype (flattened)."""
    AsyncSum(tensors, group).wait()


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype, groups in the same order on every rank."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return [groups[dtype] for dtype in sorted(groups, key=str)]


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
