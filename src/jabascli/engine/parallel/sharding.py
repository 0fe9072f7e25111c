"""Sharded data parallel (FSDP2) over the data-parallel ranks, exact under IIDP's uneven micro-batch counts.

Every block of the workload (``blocks(model)``) and then the whole model become
FSDP2 units over a CPU or CUDA ``DeviceMesh`` of the DP ranks (bottom-up, as
torchtitan does). Between iterations a rank holds ``1/N`` of every parameter,
its gradient and its optimizer state. Within an iteration:

* gradients are SUM-reduced (``set_force_sum_reduction_for_comms(True)``,
  gradient divide factor 1.0: FSDP2's AVG reduction has summed on gloo,
  pytorch#162338, and IIDP divides by itself). Every micro-batch's loss is
  already divided by the job's micro-batch count ``GBS / LBS``, so the sum is
  the mean gradient over all GBS samples, whatever each rank's count;
* gradients are reduce-scattered only in a rank's last backward
  (``set_requires_gradient_sync``): earlier micro-batches accumulate into the
  unsharded gradients;
* ``grads``, or ``full`` when the ranks run unequal micro-batch counts: the
  parameters are all-gathered in the first forward and stay gathered until the
  last backward has reduce-scattered (``reshard_after_forward`` and
  ``reshard_after_backward`` off until then). So every rank issues the same
  collectives, one all-gather and one reduce-scatter per unit, in the same
  order, however many micro-batches it runs: replicas on faster devices that
  run more micro-batches never deadlock the slower ones;
* ``full`` when every rank runs the same micro-batch count: ZeRO-3 proper,
  parameters resharded after every forward and gathered again for backward;
  every rank still issues the same collectives, because it runs as many
  micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from jabascli.engine.sampler import MicroBatch

SHARDINGS = ("full", "grads")


def shard_model(
    model: nn.Module,
    blocks: Sequence[nn.Module] | None,
    mesh: DeviceMesh,
    *,
    ignored: set[nn.Parameter] | None = None,
    root: bool = True,
) -> list[FSDPModule]:
    """Make every block, then ``model``, an FSDP2 unit over ``mesh``, reducing by plain sums; returns the units.

    ``ignored``: parameters of ``model`` that stay whole (per-block ``layers``); ``root=False``: ``model``
    itself is no unit, so what lies outside ``blocks`` stays whole. Call before the optimizer is built:
    FSDP2 replaces the parameters by sharded ``DTensor`` ones.
    """
    units: list[FSDPModule] = []
    for block in blocks or ():
        units.append(fully_shard(block, mesh=mesh))  # type: ignore[arg-type]
    if root:
        units.append(fully_shard(model, mesh=mesh, ignored_params=ignored))  # type: ignore[arg-type]
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return units


class MicroStep(Protocol):
    """A worker micro-step (:class:`~jabascli.engine.vsw.WorkerStep`): forward, ``loss / (GBS / LBS)``, backward."""

    def __call__(self, module: nn.Module, replica: int, mb: MicroBatch, *, sync: bool = False) -> None: ...


class ShardedMicroBatches:
    """Runs a rank's micro-batches of one iteration on its sharded model (see the module docstring)."""

    def __init__(self, model: nn.Module, units: Sequence[FSDPModule], sharding: str) -> None:
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding {sharding!r} is not one of {SHARDINGS}")
        self.model, self.units, self.sharding = model, list(units), sharding

    def run(self, micro_batches: Sequence[MicroBatch], step: MicroStep | Callable[..., None], equal: bool) -> None:
        """``equal``: every DP rank runs ``len(micro_batches)`` micro-batches this iteration."""
        gathered = self.sharding == "grads" or not equal
        *local, last = micro_batches
        self._set(sync=False, reshard_forward=not gathered, reshard_backward=not gathered)
        for mb in local:
            step(self.model, 0, mb)
        self._set(sync=True, reshard_forward=not gathered, reshard_backward=True)
        step(self.model, 0, last, sync=True)

    def _set(self, *, sync: bool, reshard_forward: bool, reshard_backward: bool) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)
            unit.set_reshard_after_forward(reshard_forward, recurse=False)
            unit.set_reshard_after_backward(reshard_backward, recurse=False)


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of an FSDP2 unit: the sharded one (what ``model.parameters()`` holds between iterations),
    the unit, and the dimension FSDP2 shards it on (every DP rank holds ``torch.chunk(whole, N, dim)[its index]``)."""

    unit: FSDPModule
    sharded: nn.Parameter
    dim: int
    state: Any
    """FSDP2's ``FSDPParam`` (no public API names it)."""

    def leaf(self) -> torch.Tensor | None:
        """The tensor autograd accumulates the gradient into during backward: FSDP2's unsharded parameter. With
        gradient sync off and no reduce dtype its ``.grad`` is the rank's gradient summed over the micro-batches
        so far, until the last backward reduce-scatters it. FSDP2 makes it at the unit's first all-gather and keeps
        it for the unit's life (torch 2.13: ``FSDPParam.init_unsharded_param``); None before that."""
        return getattr(self.state, "_unsharded_param", None)


def sharded_params(units: Sequence[FSDPModule]) -> list[ShardedParam]:
    """Every parameter the FSDP2 ``units`` hold (:mod:`jabascli.adaptive.layout_measure` reads their gradients
    before the reduce-scatter)."""
    found = []
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            found += [ShardedParam(unit, fp.sharded_param, fp.fsdp_placement.dim, fp) for fp in group.fsdp_params]
    return found
