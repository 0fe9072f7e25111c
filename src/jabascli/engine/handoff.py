"""Moving a running job in place: the trainers that stay carry on into the next generation.

A move whose new allocation keeps rank 0's server (and device) does not need
every trainer to exit and a new set to start. The controller (``jabas
worker``) writes the move into rank 0's control file (:mod:`jabascli.engine.control`)
as JSON::

    {"when": "now", "handoff": {"generation": 5, "world_size": 3,
                                "plan": {... plan file form ...},
                                "ranks": {"0": 0, "1": 1}}}

``ranks`` maps the old ranks that stay (*survivors*) to their new ranks; the
others leave. At the stop, every rank writes nothing but rank 0 writes the
checkpoint as always; then rank 0 shares the handoff with every old rank (one
broadcast of its JSON bytes: JSON, never a pickle), leavers exit 0, and each
survivor leaves the old process group and joins generation 5's
(:func:`jabascli.engine.distributed.rejoin`) beside the ranks started for it
(*joiners*, which resume from the checkpoint like any restart). A survivor
builds its trainer anew from that same checkpoint, keeping only what a move
cannot change (the workload, its datasets, the loader workers): every rank of
the new generation starts from the same bytes, as after a restart, so the
exactness of restarts carries over unchanged. What a move then costs is the
checkpoint written and read plus a rendezvous in a store already connected,
not new processes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from jabascli.engine.distributed import DistEnv
from jabascli.errors import InputError

MAX_BYTES = 1 << 20
"""A handoff larger than this is refused (a plan of thousands of ranks is still far smaller)."""


@dataclass(frozen=True)
class Handoff:
    """The next generation, as the controller described it."""

    generation: int
    world_size: int
    plan: dict[str, Any]
    """The new plan, in the plan file form (:meth:`jabascli.engine.plan.TrainingPlan.to_dict`)."""
    ranks: dict[int, int]
    """Old rank -> new rank, for the ranks that stay."""

    @classmethod
    def from_json(cls, data: Any, source: str = "handoff") -> Handoff:
        try:
            ranks = {int(old): int(new) for old, new in dict(data["ranks"]).items()}
            handoff = cls(int(data["generation"]), int(data["world_size"]), dict(data["plan"]), ranks)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError.at(source, None, f"not a handoff ({type(exc).__name__}: {exc})") from None
        if not all(0 <= new < handoff.world_size for new in ranks.values()) or 0 not in ranks:
            raise InputError.at(source, "ranks", "old rank 0 must stay, and every new rank be in the new world")
        return handoff

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ranks": {str(k): v for k, v in self.ranks.items()}}

    def env_for(self, env: DistEnv) -> DistEnv | None:
        """This rank's place in the next generation; None when it leaves."""
        new = self.ranks.get(env.rank)
        if new is None:
            return None
        return dataclasses.replace(env, rank=new, world_size=self.world_size, generation=self.generation)


def share(handoff: Handoff | None, rank: int, device: torch.device) -> Handoff | None:
    """Rank 0's handoff on every rank: a collective of the current process group, after a stop."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return handoff
    encoded = json.dumps(handoff.to_json()).encode() if rank == 0 and handoff is not None else b""
    size = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    n = int(size.item())
    if n == 0:
        return None
    if n > MAX_BYTES:
        raise InputError.at("handoff", None, f"{n} bytes, more than {MAX_BYTES}")
    data = torch.zeros(n, dtype=torch.uint8, device=device)
    if rank == 0:
        data.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    dist.broadcast(data, 0)
    return handoff if rank == 0 else Handoff.from_json(json.loads(data.cpu().numpy().tobytes()))
