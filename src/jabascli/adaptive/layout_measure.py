"""The first-half gradient of a measurement iteration under a ``[parallel]`` layout (docs/hybrid.md).

The same measurement as :class:`~jabascli.adaptive.measure.FirstHalf`, behind the
same calls (``begin``, ``finish``; ``after_backward`` and ``tap`` do nothing):
``F = sum_{w in A} g_w / W`` over the first ``W_A = floor(W / 2)`` workers,
``T`` the iteration's reduced gradient, and the three inner products
``|F|^2``, ``F.T``, ``|T|^2`` over the whole model.

A replica (``tp x pp`` ranks) runs its ranks' micro-batches in worker order, so
its first-half workers are a prefix of ``k`` of its micro-batches, on every one
of its ranks (pipeline schedules run the backwards in micro-batch order too).
The replica's share of ``F`` is its accumulated gradient right after the
``k``-th backward, *before* any reduction: a post-accumulate-grad hook on every
tensor autograd accumulates into counts the backwards and copies the local
gradient at the ``k``-th. Those tensors are the parameters themselves (plain,
or ``DTensor`` TP slices) and, for FSDP2 units, FSDP2's unsharded parameters,
whose ``.grad`` holds the rank's sum until the last backward reduce-scatters it
(:class:`~jabascli.engine.parallel.sharding.ShardedParam`). The hooks exist only
during a measurement iteration.

After the iteration (every reduction done): the copies are SUM-all-reduced over
the DP ranks (one flat buffer: a replica's share plus the others'); an FSDP2
parameter's copy is whole, so each rank keeps the chunk its shard of ``T``
holds (``torch.chunk`` along FSDP2's dimension). The products are then local
sums over each rank's part, summed over the mesh dimensions each part is
sharded on and over the pipeline stages
(:meth:`~jabascli.engine.parallel.replica.Replica.sum_parts`, as the global-norm
clip does): the same numbers plain IIDP computes from whole gradients.

Cost on a measurement iteration: a copy of this rank's unsharded gradient (for
FSDP2 units: the whole parameter's, as FSDP2 itself holds between micro-batches
under unequal counts), one all-reduce of it over the DP ranks, and a few scalar
all-reduces. Under FSDP2 x TP a copy is the TP-local slice of the unsharded
parameter, chunked over the DP ranks as FSDP2 chunks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from jabascli.adaptive.estimators import HalfGradients, half_split
from jabascli.engine.parallel.replica import Replica, local_part
from jabascli.engine.parallel.sharding import ShardedParam, sharded_params
from jabascli.engine.sampler import Iteration, MicroBatch


class LayoutFirstHalf:
    """This rank's part of the first-half measurement under a layout (see the module docstring)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.params = [p for p in replica.model.parameters() if p.requires_grad]
        self._sharded: dict[nn.Parameter, ShardedParam] = {
            s.sharded: s for s in sharded_params(replica.units) if s.sharded.requires_grad
        }
        self.active = False
        self._prefix = 0
        self._copies: list[torch.Tensor | None] = []
        self._handles: list[RemovableHandle] = []

    def begin(self, iteration: Iteration, workers: int, replicas: Sequence[Sequence[nn.Parameter]]) -> None:
        """Arm for this iteration (``iteration``: the replica's micro-batches; ``replicas`` is not used: a
        layout's replica is one model)."""
        split = half_split(workers)
        self.active = split > 0
        if not self.active:
            return
        self._prefix = sum(mb.worker < split for mb in iteration.micro_batches)
        self._copies = [None] * len(self.params)
        if self._prefix == 0:
            return  # none of this replica's micro-batches is in the first half: its share is zero
        for index, param in enumerate(self.params):
            sharded = self._sharded.get(param)
            leaf = param if sharded is None else sharded.leaf()
            if leaf is not None:
                self._handles.append(leaf.register_post_accumulate_grad_hook(self._counter(index)))
            else:  # an FSDP2 unit that has not gathered yet: hook its unsharded parameter once its forward has
                assert sharded is not None
                self._handles.append(sharded.unit.register_forward_pre_hook(self._late(index, sharded)))

    def _counter(self, index: int) -> Callable[[torch.Tensor], None]:
        count = 0

        def accumulated(leaf: torch.Tensor) -> None:
            nonlocal count
            count += 1
            if count == self._prefix:
                assert leaf.grad is not None
                grad = leaf.grad.to_local() if isinstance(leaf.grad, DTensor) else leaf.grad
                self._copies[index] = grad.detach().clone()

        return accumulated

    def _late(self, index: int, sharded: ShardedParam) -> Callable[..., None]:
        hooked = False

        def pre_forward(*_: Any) -> None:  # after FSDP2's own pre-forward (prepended), which made the leaf
            nonlocal hooked
            leaf = sharded.leaf()
            if not hooked and leaf is not None:
                hooked = True
                self._handles.append(leaf.register_post_accumulate_grad_hook(self._counter(index)))

        return pre_forward

    def after_backward(self, replica: int, mb: MicroBatch) -> None:
        """Nothing: the hooks take the prefix's gradient (the engine's worker step calls this)."""

    def tap(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing: a layout has no DDP communication hook."""

    def finish(self, workers: int, lbs: int) -> HalfGradients | None:
        """After the iteration's backward and reductions: the inner products (None if not armed)."""
        if not self.active:
            return None
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        copies = [self._copy_or_zeros(i, p) for i, p in enumerate(self.params)]
        dp = self.replica.mesh["dp"]
        if dp.size() > 1:  # F: every replica's share, summed
            flat = _flatten_dense_tensors(copies)
            dist.all_reduce(flat, group=dp.get_group())
            copies = list(_unflatten_dense_tensors(flat, copies))
        parts: dict[tuple[str, ...], torch.Tensor] = {}
        for param, copy in zip(self.params, copies, strict=True):
            dims, t = local_part(param.grad) if param.grad is not None else local_part(param.detach())
            if param.grad is None:
                t = torch.zeros_like(t)
            f = copy
            sharded = self._sharded.get(param)
            if sharded is not None:  # whole: keep what this rank's shard holds
                chunks = torch.chunk(copy, dp.size(), dim=sharded.dim)
                index = dp.get_local_rank()
                f = chunks[index] if index < len(chunks) else copy.narrow(sharded.dim, 0, 0)
            if f.shape != t.shape:
                raise RuntimeError(f"first-half gradient of shape {tuple(f.shape)} against {tuple(t.shape)}")
            f, t = f.to(torch.float64).reshape(-1), t.to(torch.float64).reshape(-1)
            products = torch.stack([f.dot(f), f.dot(t), t.dot(t)])
            parts[dims] = parts[dims] + products if dims in parts else products
        if not parts:
            parts[()] = torch.zeros(3, dtype=torch.float64, device=self.params[0].device)
        ff, ft, tt = (float(x) for x in self.replica.sum_parts(parts).tolist())
        return HalfGradients(ff, ft, tt, workers, lbs)

    def _copy_or_zeros(self, index: int, param: nn.Parameter) -> torch.Tensor:
        """The prefix's local gradient, or zeros of its shape (no first-half micro-batch, or an unused parameter)."""
        copy = self._copies[index]
        if copy is not None:
            return copy
        sharded = self._sharded.get(param)
        tensor = param if sharded is None else sharded.leaf()
        if tensor is None:  # a unit not gathered yet: the whole (or TP-local) size FSDP2 noted
            shape = sharded.state._orig_size  # type: ignore[union-attr]
        else:
            shape = tensor.to_local().shape if isinstance(tensor, DTensor) else tensor.shape
        return torch.zeros(shape, dtype=param.dtype, device=param.device)
