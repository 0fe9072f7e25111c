"""A checkpoint's model, whole, as a plain ``torch.save`` dict of tensors: what a user takes elsewhere.

Any checkpoint exports alike: a plain IIDP ``checkpoint-<step>.pt`` or a hybrid
layout's ``checkpoint-<step>.dcp`` folder (whose shards read back whole,
:func:`jabascli.engine.parallel.dcp.read_sharded`). The file is the model's
state dict by parameter and buffer name, the names of the workload's model, so
``model.load_state_dict(torch.load(path, weights_only=True))`` restores it.
Written atomically: a failed export leaves nothing, or the previous file, at ``out``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from jabascli.atomic import atomic_write
from jabascli.engine.checkpoint import load_found, resolve_checkpoint
from jabascli.errors import InputError


@dataclass(frozen=True)
class Exported:
    """What :func:`export_model` wrote, and from where."""

    checkpoint: Path
    step: int
    out: Path
    tensors: int
    elements: int
    passed_over: list[str] = field(default_factory=list)
    """Newer checkpoints of the folder that failed their integrity check."""


def export_model(source: Path, out: Path) -> Exported:
    """Write the model of ``source`` (a checkpoint, or a job's checkpoint folder: its newest intact one) to ``out``."""
    if out.is_dir():
        raise InputError.at(out, None, "is a folder: --out names the file to write (e.g. model.pt)")
    found = resolve_checkpoint(source)
    payload = load_found(found)
    model = {name: tensor.detach().clone() for name, tensor in payload["model"].items()}
    atomic_write(out, lambda f: torch.save(model, f))
    step = payload["progress"]["step"]
    elements = sum(t.numel() for t in model.values())
    return Exported(found.path, step, out, len(model), elements, found.passed_over)
