"""A ``[parallel]`` layout in the trainer: built in one place, run behind the VSW strategy's interface.

The trainer (:mod:`jabascli.engine.trainer`) runs a rank's micro-batches through
one object with the calls of :class:`~jabascli.engine.vsw.VswStrategy`
(``zero_grad``, ``run(micro_batches, step)``, ``after_step``,
``replica_params``, and for validation ``share``, ``evaluating``, ``forward``).
Without a layout that object is a VSW strategy over DDP; with one it is a
:class:`LayoutWorkers`, which :func:`build_layout_workers` makes from the model
(:func:`~jabascli.engine.parallel.replica.build_replica`: pipeline stage, TP,
checkpointing, FSDP2). Per iteration, on every rank of a replica::

    for each micro-batch of the replica (those the plan deals to all of its ranks, in rank order):
        forward, loss / (GBS / LBS), backward    # TP: collectives inside; pp > 1: the pipeline's schedule
    FSDP2: reduce-scatter in the rank's last backward only (ShardedMicroBatches)
    several replicas: the gradients no FSDP2 unit holds, one all-reduce (SUM) over the DP ranks
    loss, stop flag, running statistics: one all-reduce (SUM) over every rank

The loss rides in that all-reduce from one rank per replica only (TP rank 0 of
the last stage), so the sum is the loss over all GBS / LBS micro-batches, as in
plain IIDP. What a layout does not do: VSW ``streams`` (a replica is one model)
and ``overlap`` weight sync (FSDP2 and TP reduce inside backward); the trainer
runs ``sequential`` and says why in its start event (:data:`FALLBACK`).

Gradient clipping uses the global norm over every rank's local part
(:func:`clip_grad_norm`); fp16 loss scaling (its skip decision reads local
shards), autocast under pipeline stages and BatchNorm's running statistics under
``tp``/``pp`` are refused in one line (:func:`check_trainer_layout_inputs`). The
adaptive GBS measurement reads the replica's gradient before its reductions
(:mod:`jabascli.adaptive.layout_measure`).

The modules that build and save a layout (DTensor, FSDP2, pipelining, DCP: about a second to import) are
imported where a layout is built, saved or restored, so that a plain IIDP trainer starts without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from jabascli.config import LoadedConfig
from jabascli.config.models import ParallelConfig
from jabascli.engine.buffers import BufferSync, norm_layers
from jabascli.engine.checkpoint import (
    CheckpointState,
    Progress,
    extra_payload,
    is_sharded,
    load_found,
    resolve_checkpoint,
    set_rng_states,
)
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.parallel.checkpointing import checkpoint_blocks
from jabascli.engine.parallel.layout import Layout, resolve_layout
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import MicroBatch
from jabascli.engine.vsw import Emulation, WorkerStep
from jabascli.errors import InputError
from jabascli.workload import Workload

if TYPE_CHECKING:  # DTensor, FSDP2, pipelining and DCP: imported where a layout is built (module docstring)
    from jabascli.engine.parallel.pipeline import PipelineMicroBatches
    from jabascli.engine.parallel.replica import Replica

FALLBACK = "a [parallel] layout runs one model per replica, reduced inside backward (FSDP2, TP): sequential"


def trainer_layout(
    loaded: LoadedConfig, workload: Workload, model: nn.Module, planned: ParallelConfig | None = None
) -> Layout | None:
    """The layout the trainer builds, or None: no ``[parallel]``, or one that needs no device mesh.

    ``planned``: the plan file's layout (``jabas solve --hybrid``), which wins over ``[parallel]``.

    ``checkpointing`` alone needs none: its blocks are checkpointed here, in place, and the model
    trains as plain IIDP (VSW replicas, deep copies, keep it).
    """
    if (planned or loaded.config.parallel) is None:
        return None
    blocks = workload.blocks(model)
    layout = resolve_layout(loaded, workload, None if blocks is None else len(blocks), planned)
    if layout is None or (layout.tp == 1 and layout.pp == 1 and layout.sharding == "none"):
        checkpoint_blocks(blocks or [], layout.checkpointed if layout is not None else ())
        return None
    return layout


def describe_layout(layout: Layout | None) -> str | None:
    """One line for the start event, e.g. ``tp 2, pp 2 (blocks 0-2 | 3-3, 1f1b), sharding full``."""
    if layout is None:
        return None
    parts = [f"tp {layout.tp}"] if layout.tp > 1 else []
    if layout.pp > 1:
        stages = " | ".join(f"{first}-{last}" for first, last in layout.stages)
        parts.append(f"pp {layout.pp} (blocks {stages}, {layout.schedule})")
    if layout.sharding != "none":
        parts.append(f"sharding {layout.sharding}")
    if layout.checkpointed:
        parts.append(f"checkpointing blocks {', '.join(map(str, layout.checkpointed))}")
    return ", ".join(parts)


def check_trainer_layout_inputs(loaded: LoadedConfig, layout: Layout, model: nn.Module, workload: Workload) -> None:
    """Refuse, in one line naming the field, what a layout does not train exactly (module docstring), and a
    ``tp`` that cannot split the model's blocks."""
    cfg, file = loaded.config, loaded.path
    if layout.tp > 1:
        from jabascli.engine.parallel.tensor import tp_problem

        problem = tp_problem(workload.blocks(model) or [], workload, layout.tp)
        if problem is not None:
            raise InputError.at(file, "parallel.tp", problem)
    if cfg.job.precision == "fp16":
        raise InputError.at(
            file, "job.precision", "fp16 with a [parallel] layout: its inf/NaN skip reads only this rank's shards"
        )
    if cfg.job.precision != "fp32" and layout.pp > 1:
        raise InputError.at(file, "job.precision", f"{cfg.job.precision} with parallel.pp > 1: stages run in fp32")
    split = layout.tp > 1 or layout.pp > 1
    if split and any(m.track_running_stats for m in norm_layers(model)):
        raise InputError.at(
            file, "parallel", "running statistics (BatchNorm) with tp or pp > 1: use sharding, or no [parallel]"
        )
    if layout.pp > 1 and any(True for _ in model.buffers()):
        raise InputError.at(file, "parallel.pp", "the model has buffers, which pipeline stages do not keep in step")


class LayoutWorkers:
    """Runs this rank's part of its replica's micro-batches (see the module docstring)."""

    name = "layout"
    keeps_gradients = False
    """Gradients are dropped after each step (:meth:`zero_grad`) and made again in the next backward."""

    def __init__(self, replica: Replica, layout: Layout, workload: Workload, device: torch.device) -> None:
        self.replica, self.layout, self.model = replica, layout, replica.model
        self.replicas: list[nn.Module] = [replica.model]
        self.ranks = replica.ranks
        self.device = device
        last_stage = replica.stage == layout.pp - 1
        self.owns_loss = last_stage and replica.mesh.get_local_rank("tp") == 0
        """The one rank of the replica whose loss counts (TP ranks compute the same one)."""
        from jabascli.engine.parallel.pipeline import PipelineMicroBatches
        from jabascli.engine.parallel.sharding import ShardedMicroBatches

        self.dtype = next(replica.model.parameters()).dtype
        self.sharded = ShardedMicroBatches(replica.model, replica.units, layout.sharding) if replica.units else None
        self.pipeline: PipelineMicroBatches | None = None
        if layout.pp > 1:
            group = replica.mesh["pp"].get_group()
            self.pipeline = PipelineMicroBatches(
                replica.model, replica.stage, layout.pp, device, layout.schedule, workload.loss, 1, group
            )
        self.equal = True
        self._stage_ranks = [replica.ranks[s * layout.tp + replica.mesh.get_local_rank("tp")] for s in range(layout.pp)]

    def emulate(self, emulation: Emulation, workload: Workload) -> None:
        """An emulated slower device: with pipeline stages, the stage's blocks sleep (:func:`emulate_blocks`);
        elsewhere the worker step does, per micro-batch."""
        if self.pipeline is not None and emulation.active:
            emulate_blocks(workload.blocks(self.model) or [], emulation)

    # -- per plan --------------------------------------------------------------------------------

    def attach(self, vsw: Any, buffers: BufferSync, plan: TrainingPlan) -> None:
        """Take a plan (``vsw`` is this object: it also combines the gradients): its micro-batch counts and loss
        divisor. The statistics and loss get an all-reduce of their own."""
        buffers.carried = False
        counts = {sum(plan.rank(r).micro_steps for r in ranks) for ranks in _replicas(plan.world_size, self.ranks)}
        self.equal = len(counts) == 1
        if self.pipeline is not None:
            self.pipeline.follow(plan.workers)

    # -- per iteration ---------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def run(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None:
        """Forward and backward of the replica's micro-batches; then launch the loss's all-reduce."""

        def local(module: nn.Module, replica: int, mb: MicroBatch, *, sync: bool = False) -> None:
            step(module, replica, mb)  # never WorkerStep's sync: there is no DDP hook to carry the sum

        if self.pipeline is not None:
            self._pipelined(micro_batches, step)
        elif self.sharded is not None:
            self.sharded.run(micro_batches, local, self.equal)
        else:
            for mb in micro_batches:
                local(self.model, 0, mb)
        self.replica.sync_gradients()  # several replicas: what no FSDP2 unit holds, summed over them
        loss = step.loss_sum if self.owns_loss and step.loss_sum is not None else None
        step.loss_sum = torch.zeros((), dtype=self.dtype, device=self.device) if loss is None else loss.to(self.dtype)
        step.buffers.launch(step.loss_sum)

    def _pipelined(self, micro_batches: Sequence[MicroBatch], step: WorkerStep) -> None:
        assert self.pipeline is not None
        if step.feed is None:
            inputs, target = step.load([i for mb in micro_batches for i in mb.indices])
        else:  # the loader workers load the same micro-batches: one batch of them
            parts = [step.feed.take(mb) for mb in micro_batches]
            inputs, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        step.timer.mark("data")
        losses = self.pipeline.run(len(micro_batches), inputs, target)
        if losses:
            step.loss_sum = torch.stack([loss.detach() for loss in losses]).sum() * self.pipeline.workers
        step.timer.mark("bwd")

    def replica_params(self) -> list[list[nn.Parameter]]:
        return []

    def after_step(self) -> None:
        """Nothing to copy: a replica is one model."""

    # -- validation ------------------------------------------------------------------------------

    def share(self, plan: TrainingPlan, rank: int) -> tuple[int, int]:
        """(first worker, workers) of this rank's replica: its ranks validate those samples together."""
        return plan.worker_offset(self.ranks[0]), sum(plan.rank(r).micro_steps for r in self.ranks)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Validation: FSDP2 units gathered once for all of the rank's forwards (ranks run unequal counts)."""
        units = self.replica.units
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def forward(self, inputs: Any) -> Any:
        """The model's output for a validation batch where it counts (:attr:`owns_loss`), else None.

        With pipeline stages the hidden state goes from stage to stage (its shape first).
        """
        if self.pipeline is None:
            output = self.model(*inputs) if isinstance(inputs, tuple) else self.model(inputs)
            return output if self.owns_loss else None
        stage, last = self.replica.stage, self.layout.pp - 1
        x = inputs if stage == 0 else self._receive(self._stage_ranks[stage - 1])
        y = self.model(x)
        if stage < last:
            self._send(y, self._stage_ranks[stage + 1])
        return y if self.owns_loss else None

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        shape = torch.tensor([tensor.ndim, *tensor.shape] + [0] * (8 - tensor.ndim), device=self.device)
        dist.send(shape, to)
        dist.send(tensor.contiguous(), to)

    def _receive(self, source: int) -> torch.Tensor:
        shape = torch.zeros(9, dtype=torch.int64, device=self.device)  # NCCL sends device tensors only
        dist.recv(shape, source)
        ndim = int(shape[0])
        tensor = torch.empty([int(s) for s in shape[1 : 1 + ndim]], dtype=self.dtype, device=self.device)
        dist.recv(tensor, source)
        return tensor

    # -- the update ------------------------------------------------------------------------------

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, over every rank's part (module docstring).

        ``||g||^2`` is the sum over parameters of their local squares: a DTensor's summed over the mesh
        dimensions it is sharded on, a plain (replicated) one counted once; with pipeline stages, summed
        over the stages. The factor ``min(1, X / (||g|| + 1e-6))`` is ``clip_grad_norm_``'s.
        """
        from torch.distributed.tensor import DTensor

        from jabascli.engine.parallel.replica import local_part

        grads = [p.grad for p in params if p.grad is not None]
        totals: dict[tuple[str, ...], torch.Tensor] = {}
        for g in grads:
            dims, local = local_part(g)
            square = local.detach().to(torch.float64).pow(2).sum()
            totals[dims] = totals[dims] + square if dims in totals else square
        total = self.replica.sum_parts(totals or {(): torch.zeros((), dtype=torch.float64, device=self.device)})
        norm = total.sqrt()
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(factor.to(local.dtype))
        return norm


def emulate_blocks(blocks: Sequence[nn.Module], emulation: Emulation) -> None:
    """Every block sleeps ``slowdown - 1`` times the CPU time of its forward and of its backward, after each
    (module hooks: the pipeline's schedule runs the micro-batches, not the worker step)."""
    for block in blocks:
        starts: dict[str, float] = {}

        def begin(key: str, starts: dict[str, float] = starts) -> Callable[..., None]:
            return lambda *_: starts.__setitem__(key, emulation.clock())

        def end(key: str, starts: dict[str, float] = starts) -> Callable[..., None]:
            return lambda *_: emulation.pause_since(starts.pop(key))

        block.register_forward_pre_hook(begin("forward"))
        block.register_forward_hook(end("forward"))
        block.register_full_backward_pre_hook(begin("backward"))
        block.register_full_backward_hook(end("backward"))


def _replicas(world: int, ranks: Sequence[int]) -> list[range]:
    """Every replica's ranks: consecutive blocks of ``len(ranks)`` (the (dp, pp, tp) mesh's order)."""
    size = len(ranks)
    return [range(first, first + size) for first in range(0, world, size)]


def save_layout_checkpoint(store: CheckpointStore, state: CheckpointState) -> Path:
    """Collective: every rank writes its shards of ``state``'s model and optimizer
    (:func:`~jabascli.engine.parallel.dcp.save_sharded`), rank 0 the rest of the payload
    (:func:`~jabascli.engine.checkpoint.extra_payload`); the committed folder."""
    from jabascli.engine.parallel.dcp import save_sharded

    p = state.progress
    extra = extra_payload(state)
    return save_sharded(store, step=p.step, epoch=p.epoch, model=state.model, optimizer=state.optimizer, extra=extra)


def restore_layout_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None
) -> tuple[dict[str, Any], Progress]:
    """Collective: resume ``path`` (a checkpoint, or a job's folder: its newest intact one) of any layout, plain
    IIDP's included, resharded to this rank's part; the payload without model and optimizer, and the progress."""
    from jabascli.engine.parallel.dcp import load_sharded, load_whole

    found = resolve_checkpoint(path)
    if is_sharded(found.path):
        payload = load_sharded(found.path, model, optimizer)
    else:  # a plain IIDP checkpoint, of the whole model
        payload = load_found(found)
        load_whole(found.path, payload, model, optimizer)
        payload = {k: v for k, v in payload.items() if k not in ("model", "optimizer")}
    if scheduler is not None and payload.get("lr_scheduler") is not None:
        scheduler.load_state_dict(payload["lr_scheduler"])
    set_rng_states(payload["rng"])
    return payload, Progress(**payload["progress"])


def build_layout_workers(model: nn.Module, workload: Workload, layout: Layout, device: torch.device) -> LayoutWorkers:
    """Parallelise ``model`` for ``layout`` (the process group must exist) and run it as this rank's workers.

    Build the optimizer afterwards, over ``workers.model.parameters()``: TP and sharding replace parameters.
    """
    from jabascli.engine.parallel.replica import build_replica

    return LayoutWorkers(build_replica(model, workload, layout, device.type), layout, workload, device)
