"""Whole (unsharded) parameters across replicas: their gradients summed over the DP dimension.

With several replicas (``N / (tp x pp) > 1``), a parameter that no FSDP2 unit
holds (every parameter with ``sharding = "none"``; the blocks ``layers`` keeps
plain, and what lies outside the blocks, under a sharded layout) is whole on
every replica, or its TP slice on every replica's TP rank of the same index.
Each replica accumulates, over its own micro-batches, the sum of
``grad(loss_mb) / (GBS / LBS)``; after a replica's last micro-batch its
gradient is SUM-all-reduced over the DP ranks of its ``(pp, tp)`` position::

    g = sum over replicas r of sum over r's micro-batches mb of grad(loss_mb) / (GBS / LBS)

which is the mean gradient over all GBS samples, as plain IIDP computes it. The
all-reduce comes once, after every micro-batch, so replicas that run unequal
micro-batch counts (faster devices, more) issue the same collectives. A TP
parameter's gradient is a ``DTensor`` sharded over the TP group: its local slice
is all-reduced with the slices of the same index in the other replicas. The
gradients of one dtype travel as one flat buffer (one collective, not one per
parameter: on loopback gloo a collective's fixed cost dwarfs a small tensor's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def all_reduce_gradients(params: Sequence[nn.Parameter], dp_mesh: DeviceMesh) -> None:
    """SUM-all-reduce the gradient of every parameter in ``params`` over ``dp_mesh``'s ranks, in place.

    Every DP rank passes its parameters in the same order (the model's), so the buffers match. A
    parameter without a gradient (unused this iteration) contributes zeros, so their layout never differs.
    """
    if dp_mesh.size() == 1:
        return
    group = dp_mesh.get_group()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(summed)
