"""The layout of a replica: ``[parallel]`` resolved against the workload's blocks.

:func:`resolve_layout` is the one place that turns the config section into a
:class:`Layout` and refuses, in one line naming the field, what the workload or
the runtime cannot honour. What the runtime honours so far: ``sharding``
(``full``, ``grads``) over the data-parallel ranks, ``checkpointing``, and
``tp`` or ``pp`` as the job's single replica. Per-block ``layers``, and ``tp``
or ``pp`` with sharding, with each other or with several replicas, are validated against the cluster
(:mod:`jabascli.config.parallel_checks`) and the workload, then refused as not
built yet, rather than trained wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from jabascli.config import LoadedConfig
from jabascli.config.models import ParallelConfig
from jabascli.engine.parallel.pipeline import stage_ranges
from jabascli.errors import InputError
from jabascli.workload import Workload


@dataclass(frozen=True)
class Layout:
    """How every replica runs: ``tp`` ranks per replica, the model sharded over the DP ranks or not."""

    tp: int
    pp: int
    stages: tuple[tuple[int, int], ...]
    """Each pipeline stage's inclusive block range (one stage of every block when ``pp`` is 1)."""
    schedule: str
    sharding: str
    """``none``, ``full`` or ``grads`` (docs/hybrid.md)."""
    checkpointed: tuple[int, ...]
    """Indices of the blocks whose activations are recomputed in backward."""

    @property
    def plain(self) -> bool:
        """Nothing to build: a whole replica per rank, as without ``[parallel]``."""
        return self.tp == 1 and self.pp == 1 and self.sharding == "none" and not self.checkpointed


def resolve_layout(
    loaded: LoadedConfig, workload: Workload, block_count: int | None, planned: ParallelConfig | None = None
) -> Layout | None:
    """The job's layout, or None without ``[parallel]``. ``block_count``: ``len(workload.blocks(model))``,
    None when the workload declares no blocks. ``planned``: a plan file's ``parallel`` (``jabas solve --hybrid``),
    which wins over the config's ``[parallel]``."""
    parallel, file = planned or loaded.config.parallel, loaded.path
    if parallel is None:
        return None
    if planned is None and parallel.plan == "auto":
        raise InputError.at(
            file,
            "parallel.plan",
            '"auto" takes the layout from a hybrid plan file (`jabas run` solves one, or '
            "`jabas solve --hybrid --out` then --plan), and none was given",
        )

    def refuse(field: str, message: str) -> InputError:
        return InputError.at(file, f"parallel.{field}", message)

    asks_blocks = parallel.pp > 1 or parallel.checkpointing != "none" or parallel.layers or parallel.stages
    if block_count is None and (parallel.tp > 1 or asks_blocks):
        field = "tp" if parallel.tp > 1 else "pp" if parallel.pp > 1 else "checkpointing"
        raise refuse(
            field,
            f"workload {workload.name!r} declares no blocks (and no TP plan): it trains with tp = 1 and pp = 1, "
            "without checkpointing or layers (docs/workloads.md: blocks, tp_plan)",
        )
    if parallel.tp > 1 and not _declares(workload, "tp_plan"):
        raise refuse("tp", f"workload {workload.name!r} declares no TP plan (tp_plan): it trains with tp = 1 only")
    if parallel.pp > 1 and not _declares(workload, "pipeline_stage"):
        raise refuse("pp", f"workload {workload.name!r} declares no pipeline_stage: it trains with pp = 1 only")
    for field, ranges in (("stages", parallel.stages or []), ("layers", [la.blocks for la in parallel.layers or []])):
        beyond = [r for r in ranges if block_count is not None and r[1] >= block_count]
        if beyond:
            raise refuse(field, f"block range {list(beyond[0])} is past the model's {block_count} blocks")
    if parallel.stages and block_count is not None and parallel.stages[-1][1] != block_count - 1:
        last = parallel.stages[-1][1]
        raise refuse("stages", f"leaves blocks {last + 1}-{block_count - 1} out of every stage")
    if isinstance(parallel.checkpointing, list):
        beyond_blocks = [i for i in parallel.checkpointing if block_count is not None and i >= block_count]
        if beyond_blocks:
            raise refuse("checkpointing", f"block {beyond_blocks[0]} is past the model's {block_count} blocks")
    if parallel.layers:
        raise refuse("layers", "not built yet: this jabas runs [parallel] tp, pp, sharding and checkpointing")
    if block_count is not None and parallel.pp > block_count:
        raise refuse("pp", f"{parallel.pp} stages for the model's {block_count} blocks: a stage needs a block")
    devices = sum(server.devices for server in loaded.config.available())
    for field, degree in (("tp", parallel.tp), ("pp", parallel.pp)):
        alone = parallel.tp == 1 or parallel.pp == 1
        if degree > 1 and (parallel.sharding != "none" or devices != degree or not alone):
            raise refuse(
                field,
                f"not built yet with sharding, with each other or with several replicas: {field} = {degree} "
                f'runs as the job\'s one replica ({devices} devices here), with sharding = "none"',
            )
    if parallel.checkpointing == "full":
        checkpointed = tuple(range(block_count or 0))
    elif parallel.checkpointing == "none":
        checkpointed = ()
    else:
        checkpointed = tuple(sorted(set(parallel.checkpointing)))
    stages = stage_ranges(block_count or 0, parallel.pp, parallel.stages)
    return Layout(parallel.tp, parallel.pp, tuple(stages), parallel.schedule, parallel.sharding, checkpointed)


def _declares(workload: Workload, function: str) -> bool:
    return callable(getattr(workload.module, function, None))


def check_trainer_layout(loaded: LoadedConfig, workload: Workload, model: nn.Module) -> None:
    """Refuse, in one line, a ``[parallel]`` layout that ``jabas train`` does not run yet.

    The layouts above are built and exact (tests/test_hybrid_exactness.py), but the trainer's
    checkpoints are whole-model ``torch.save`` files written by rank 0, which a sharded or split
    model cannot write correctly: they wait for DCP checkpoints. A plain layout trains as always.
    """
    if loaded.config.parallel is None:
        return
    blocks = workload.blocks(model)
    layout = resolve_layout(loaded, workload, None if blocks is None else len(blocks))
    if layout is not None and not layout.plain:
        raise InputError.at(
            loaded.path,
            "parallel",
            "jabas train does not run hybrid layouts yet: their checkpoints need DCP (docs/hybrid.md); "
            'remove [parallel] or keep tp = 1, pp = 1, sharding = "none", checkpointing = "none"',
        )
