"""Per-block strategies (``[parallel] layers``, Galvatron's layerwise strategies), resolved for one layout.

A block runs as ``[parallel]``'s keys say unless a ``layers`` entry names it; then
with that entry's ``tp``, ``sharding`` and ``checkpointing``. What the runtime
honours (anything else is refused in one line naming the entry's field):

* ``tp``: 1 or the replica's ``[parallel] tp``. A block of ``tp = 1`` in a TP
  group is whole on every rank of the group, which computes it alike (the
  group's inputs are identical), as the embeddings are.
* ``sharding``: ``none`` or the one mode (``full`` or ``grads``) of every
  sharded block; with pipeline stages, only the whole stage sharded or not. A sharded block is its own FSDP2 unit
  over the DP ranks; a plain block is whole on every DP rank and its gradients
  are all-reduced over them after the replica's last micro-batch
  (:mod:`~jabascli.engine.parallel.data_parallel`). The parameters outside the
  blocks follow ``[parallel] sharding``.
* ``checkpointing``: per block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jabascli.config.models import ParallelConfig
from jabascli.errors import InputError


@dataclass(frozen=True)
class BlockStrategy:
    """How one block runs."""

    tp: int
    sharding: str
    checkpointing: bool


def block_strategies(parallel: ParallelConfig, block_count: int) -> list[BlockStrategy]:
    """Every block's strategy: ``[parallel]``'s keys, or those of the ``layers`` entry that names the block."""
    checkpointing = parallel.checkpointing
    strategies = [
        BlockStrategy(
            parallel.tp,
            parallel.sharding,
            checkpointing == "full" or (isinstance(checkpointing, list) and i in checkpointing),
        )
        for i in range(block_count)
    ]
    for layer in parallel.layers or []:
        first, last = layer.blocks
        for i in range(first, last + 1):
            strategies[i] = BlockStrategy(layer.tp, layer.sharding, layer.checkpointing)
    return strategies


def check_layers(parallel: ParallelConfig, refuse: Callable[[str, str], InputError]) -> str:
    """Refuse a ``layers`` entry the runtime cannot honour (``refuse(field, message)``); returns the job's
    sharding mode: ``none``, or that of every sharded unit."""
    modes = {parallel.sharding} - {"none"}
    for i, layer in enumerate(parallel.layers or []):
        if layer.tp not in (1, parallel.tp):
            raise refuse(
                f"layers[{i}].tp",
                f"{layer.tp}: a block runs with tp = 1 or the replica's tp = {parallel.tp} ([parallel] tp)",
            )
        if layer.sharding != "none" and modes and layer.sharding not in modes:
            raise refuse(
                f"layers[{i}].sharding",
                f'not built yet: "{layer.sharding}" with "{modes.pop()}" elsewhere; every sharded block '
                "shares one mode",
            )
        if parallel.pp > 1 and (layer.sharding != "none" or parallel.sharding != "none"):
            message = f"per-block sharding is not built yet with pipeline stages (pp = {parallel.pp})"
            raise refuse(f"layers[{i}].sharding", message)
        modes |= {layer.sharding} - {"none"}
    return modes.pop() if modes else "none"
