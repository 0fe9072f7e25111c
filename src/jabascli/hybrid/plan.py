"""A hybrid plan: pipeline stages over blocks, replicas placed on device types, micro-batches per replica.

A *replica* is one copy of the whole model, split into the plan's stages; stage ``s`` of every replica holds blocks
``bounds[s] .. bounds[s+1]-1`` on ``tp`` devices of one type (one TP group, never across servers). Replicas on faster
devices run more micro-batches of ``mbs`` (the LBS) samples (IIDP), so ``GBS = mbs * sum(microbatches)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Schedule = Literal["1f1b", "gpipe"]
Sharding = Literal["none", "full"]


@dataclass(frozen=True)
class Placement:
    """Where one stage of one replica runs: ``tp`` devices of type ``device`` on server ``server``."""

    device: str
    tp: int = 1
    server: str = ""
    """Placements with the same non-empty server name talk over the server's links; others across servers."""


@dataclass(frozen=True)
class Replica:
    stages: tuple[Placement, ...]
    microbatches: int


@dataclass(frozen=True)
class Plan:
    mbs: int
    bounds: tuple[int, ...]
    """Stage ``s`` holds blocks ``bounds[s]`` to ``bounds[s+1] - 1``; ``bounds[0] == 0``, the last = block count."""
    replicas: tuple[Replica, ...]
    checkpoint: frozenset[int] = field(default_factory=frozenset)
    """Blocks whose activations are recomputed in backward (activation checkpointing)."""
    sharding: Sharding = "none"
    """``full``: optimizer state sharded over the replicas of each stage (gathered/reduce-scattered per iteration)."""
    schedule: Schedule = "1f1b"

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def gbs(self) -> int:
        return self.mbs * sum(r.microbatches for r in self.replicas)

    def stage_blocks(self, s: int) -> range:
        return range(self.bounds[s], self.bounds[s + 1])

    def describe(self) -> str:
        stages = " | ".join(f"{self.bounds[s]}-{self.bounds[s + 1] - 1}" for s in range(self.num_stages))
        reps = "; ".join(
            "+".join(f"{p.device}x{p.tp}" for p in r.stages) + f" m={r.microbatches}" for r in self.replicas
        )
        ck = f" ckpt={len(self.checkpoint)}" if self.checkpoint else ""
        return f"mbs={self.mbs} stages[{stages}] {reps} {self.sharding}{ck}"
