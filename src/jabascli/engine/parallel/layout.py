"""The layout of a replica: ``[parallel]`` resolved against the workload's blocks.

:func:`resolve_layout` is the one place that turns the config section into a
:class:`Layout` and refuses, in one line naming the field, what the workload or
the runtime cannot honour. What the runtime honours: replicas of ``tp x pp``
devices, one or several (the data-parallel, DP, dimension), ``sharding``
(``full``, ``grads``) over the DP ranks, with ``tp`` or ``pp`` or neither,
``checkpointing``, and per-block ``layers`` (:mod:`~jabascli.engine.parallel.layerwise`),
whose sharded blocks with ``pp`` are validated against the cluster
(:mod:`jabascli.config.parallel_checks`) and the workload, then refused as not
built yet, rather than trained wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jabascli.config import LoadedConfig
from jabascli.config.models import ParallelConfig
from jabascli.engine.parallel.layerwise import block_strategies, check_layers
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
    unsharded: tuple[int, ...] = ()
    """Blocks whole on every DP rank (gradients all-reduced) though ``sharding`` shards others (``layers``)."""
    outside_unsharded: bool = False
    """The parameters outside the blocks whole on every DP rank too: ``layers`` shard blocks, ``[parallel]``
    does not."""
    tp_whole: tuple[int, ...] = ()
    """Blocks whole on every rank of the TP group (a ``layers`` entry's ``tp = 1`` under ``tp > 1``)."""

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
    sharding = check_layers(parallel, refuse)
    if block_count is not None and parallel.pp > block_count:
        raise refuse("pp", f"{parallel.pp} stages for the model's {block_count} blocks: a stage needs a block")
    strategies = block_strategies(parallel, block_count or 0)
    checkpointed = tuple(i for i, s in enumerate(strategies) if s.checkpointing)
    unsharded = tuple(i for i, s in enumerate(strategies) if s.sharding == "none") if sharding != "none" else ()
    tp_whole = tuple(i for i, s in enumerate(strategies) if s.tp == 1) if parallel.tp > 1 else ()
    stages = stage_ranges(block_count or 0, parallel.pp, parallel.stages)
    return Layout(
        parallel.tp,
        parallel.pp,
        tuple(stages),
        parallel.schedule,
        sharding,
        checkpointed,
        unsharded,
        outside_unsharded=sharding != "none" and parallel.sharding == "none",
        tp_whole=tp_whole,
    )


def _declares(workload: Workload, function: str) -> bool:
    return callable(getattr(workload.module, function, None))


def stage_ranges(block_count: int, pp: int, stages: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """Each stage's inclusive ``(first, last)`` block: ``stages`` as given, else as even as whole blocks allow
    (the first ``block_count % pp`` stages one block more)."""
    if stages:
        return [tuple(s) for s in stages]  # type: ignore[misc]
    base, extra = divmod(block_count, pp)
    ranges, first = [], 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)
        ranges.append((first, first + size - 1))
        first += size
    return ranges
