"""Build a replica's model under a layout, in one place, in torchtitan's order: TP, checkpointing, sharding.

A replica is ``pp x tp`` ranks (pipeline stages of TP groups, a TP group inside
one server); the job's ``N`` ranks form ``N / (pp x tp)`` replicas, the
data-parallel (DP) dimension. The ranks form a ``(dp, pp, tp)``
:class:`DeviceMesh`, named explicitly for the CPU (gloo) or CUDA (NCCL) device
type: FSDP2's default mesh would be a CUDA one. The model is cut to the rank's
stage first (activation checkpointing is set on the blocks before, by their
indices in the whole model); per-block ``layers`` choose which blocks TP splits and
which FSDP2 shards (:mod:`~jabascli.engine.parallel.layerwise`). What no FSDP2 unit
holds is whole on every replica: :meth:`Replica.sync_gradients` sums its gradients
over the replicas (:mod:`~jabascli.engine.parallel.data_parallel`).

The micro-batches of a replica are those the plan deals to its ranks
(:func:`replica_micro_batches`): ``GBS = LBS x`` all micro-batches of all
replicas, as in plain IIDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from jabascli.engine.buffers import allreduce_sum
from jabascli.engine.parallel.checkpointing import checkpoint_blocks
from jabascli.engine.parallel.data_parallel import all_reduce_gradients
from jabascli.engine.parallel.layout import Layout
from jabascli.engine.parallel.sharding import shard_model
from jabascli.engine.parallel.tensor import parallelize_blocks
from jabascli.engine.sampler import Iteration, MicroBatch
from jabascli.workload import Workload


@dataclass
class Replica:
    """This rank's part of a replica: the model (its stage, parallelised in place), its mesh and its FSDP2 units."""

    model: nn.Module
    mesh: DeviceMesh
    units: list[FSDPModule]
    stage: int
    """This rank's pipeline stage (0 without pipelining)."""
    ranks: list[int]
    """The ranks of this rank's replica, stage by stage: they run the micro-batches the plan deals to them."""
    replicated: list[nn.Parameter] = field(default_factory=list)
    """The parameters no FSDP2 unit holds: whole on every replica, gradients all-reduced over the DP ranks."""

    def sync_gradients(self) -> None:
        """After the replica's last micro-batch: sum the replicated parameters' gradients over the replicas
        (:mod:`~jabascli.engine.parallel.data_parallel`; a collective of the DP ranks, none with one replica)."""
        all_reduce_gradients(self.replicated, self.mesh["dp"])

    def sum_parts(self, parts: dict[tuple[str, ...], torch.Tensor]) -> torch.Tensor:
        """A sum over the whole model from this rank's local sums (a collective of every rank of the job).

        ``parts[dims]``: this rank's sum over its parameters whose local tensors are shards on the mesh
        dimensions ``dims`` (a ``DTensor``'s ``Shard`` placements: ``("dp",)`` for FSDP2, ``("tp",)`` for a TP
        slice); summed over those dimensions' ranks. ``()``: whole tensors (plain, or a ``Replicate``
        placement), the same on every rank that holds them, counted once. Then summed over the pipeline
        stages, which hold different blocks. Every rank gets the same result.
        """
        total: torch.Tensor | None = None
        for dims in sorted(parts):  # the same order on every rank of a stage: they hold the same kinds
            part = parts[dims]
            for name in dims:
                allreduce_sum([part], self.mesh[name].get_group())
            total = part if total is None else total + part
        assert total is not None, "no parameters"
        if self.mesh["pp"].size() > 1:
            allreduce_sum([total], self.mesh["pp"].get_group())
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors, gathered from every shard and TP slice (a collective: every rank calls it)."""
        return {
            name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for name, tensor in self.model.state_dict().items()
        }


def local_part(tensor: torch.Tensor) -> tuple[tuple[str, ...], torch.Tensor]:
    """The mesh dimensions ``tensor`` is sharded on (none for a plain tensor or a replicated ``DTensor``) and
    this rank's local part of it (:meth:`Replica.sum_parts`)."""
    if not isinstance(tensor, DTensor):
        return (), tensor
    names = tensor.device_mesh.mesh_dim_names or ()
    # FSDP2 over a TP-sharded dimension places a _StridedShard on the DP dimension, whose is_shard() is False
    # (torch 2.13): a shard all the same.
    dims = tuple(
        n for n, p in zip(names, tensor.placements, strict=True) if p.is_shard() or isinstance(p, _StridedShard)
    )
    return dims, tensor.to_local()


def build_replica(model: nn.Module, workload: Workload, layout: Layout, device_type: str) -> Replica:
    """Parallelise ``model`` (built alike on every rank) for ``layout``; the process group must exist.

    Build the optimizer afterwards, over ``model.parameters()``: TP and sharding replace parameters.
    """
    world, rank, size = dist.get_world_size(), dist.get_rank(), layout.pp * layout.tp
    mesh = init_device_mesh(device_type, (world // size, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
    checkpoint_blocks(workload.blocks(model) or [], layout.checkpointed)
    stage = mesh.get_local_rank("pp")
    if layout.pp > 1:
        model = workload.pipeline_stage(model, *layout.stages[stage])
    offset = layout.stages[stage][0]  # the stage's blocks are numbered as in the whole model
    blocks = dict(enumerate(workload.blocks(model) or [], start=offset))
    if layout.tp > 1:
        parallelize_blocks([b for i, b in blocks.items() if i not in layout.tp_whole], workload, mesh["tp"])
    units: list[FSDPModule] = []
    replicated = list(model.parameters())
    if layout.sharding != "none":
        # Blocks `layers` keeps plain are left out of every FSDP2 unit, and all-reduced (sync_gradients).
        plain = [p for i, b in blocks.items() if i in layout.unsharded for p in b.parameters()]
        sharded = [b for i, b in blocks.items() if i not in layout.unsharded]
        units = shard_model(model, sharded, mesh["dp"], ignored=set(plain), root=not layout.outside_unsharded)
        in_units = {id(p) for b in sharded for p in b.parameters()}
        replicated = [p for p in model.parameters() if id(p) not in in_units] if layout.outside_unsharded else plain
    first = rank - rank % size
    return Replica(model, mesh, units, stage, list(range(first, first + size)), replicated)


def replica_micro_batches(iterations: Sequence[Iteration]) -> list[MicroBatch]:
    """A replica's micro-batches of one iteration: those of each of its ranks' iteration, in rank order."""
    return [mb for iteration in iterations for mb in iteration.micro_batches]
