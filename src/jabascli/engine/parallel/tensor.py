"""Tensor parallelism (DTensor) inside a replica: every block split across the replica's TP group.

Each block is parallelised with the workload's plan (``tp_plan(block)``:
``parallelize_module``'s ``{submodule: ColwiseParallel() | RowwiseParallel()}``).
With the Megatron-style plan, a linear layer split by output columns is followed
by one split by input rows, so a block's forward all-reduces its activations
once after attention and once after the MLP, and its backward once each too.
Everything outside the blocks (embeddings, final norm, head) stays whole on
every TP rank: the ranks of a TP group receive identical inputs (the replica's
micro-batch), so those parameters get identical gradients and stay identical
after identical optimizer steps, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from jabascli.workload import Workload


def parallelize_blocks(blocks: Sequence[nn.Module], workload: Workload, tp_mesh: DeviceMesh) -> None:
    """Split every block across ``tp_mesh`` by the workload's TP plan, in place.

    Call before the optimizer is built: the split weights become ``DTensor`` parameters. Rank 0 of the
    group scatters its values (``src_data_rank=0``), so every rank starts from the same model.
    """
    for block in blocks:
        plan = workload.tp_plan(block)
        if plan is None:
            raise ValueError(f"workload {workload.name!r} declares no tp_plan")
        parallelize_module(block, tp_mesh, plan, src_data_rank=0)
