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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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


def tp_problem(blocks: Sequence[nn.Module], workload: Workload, tp: int) -> str | None:
    """Why ``tp`` cannot split these blocks by the workload's plan, or None.

    A column-split linear layer needs ``tp`` to divide its output features, a row-split one its input
    features, and an attention module that declares ``head_width`` (the built-in GPT and ViT) needs ``tp``
    to divide its heads: each rank runs whole heads.
    """
    for index, block in enumerate(blocks):
        for name, style in (workload.tp_plan(block) or {}).items():
            layer = block.get_submodule(name)
            if not isinstance(layer, nn.Linear) or not isinstance(style, ColwiseParallel | RowwiseParallel):
                continue
            column = isinstance(style, ColwiseParallel)
            features, kind = (layer.out_features, "output") if column else (layer.in_features, "input")
            if features % tp:
                return f"{tp} does not divide block {index}'s {name} ({features} {kind} features)"
        for name, module in block.named_modules():
            head_width, q = getattr(module, "head_width", None), getattr(module, "q", None)
            if isinstance(head_width, int) and isinstance(q, nn.Linear) and (q.out_features // head_width) % tp:
                heads = q.out_features // head_width
                return (
                    f"{tp} does not divide block {index}'s {heads} attention heads ({name}): each rank runs whole heads"
                )
    return None
