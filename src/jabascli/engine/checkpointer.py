"""A trainer's checkpoints: the one place that chooses between one whole-model file and DCP shards.

Plain IIDP: every rank holds the whole model, so rank 0 alone writes the
checkpoint, one ``.pt`` file in the job's checkpoint store
(:mod:`jabascli.engine.checkpoint`), and every rank resumes from it. Under a
``[parallel]`` layout no rank may hold the whole model: every rank writes its
shards (DCP, :mod:`jabascli.engine.parallel.dcp`), together, and reads them back
into the built layout. Either way a checkpoint holds the same state:
:class:`~jabascli.engine.checkpoint.CheckpointState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jabascli.config import LoadedConfig
from jabascli.engine.checkpoint import CheckpointState, Progress, read_checkpoint, restore_checkpoint, save_checkpoint
from jabascli.engine.layout import checkpoint_store
from jabascli.engine.parallel.runner import restore_layout_checkpoint, save_layout_checkpoint


@dataclass(frozen=True)
class Checkpointer:
    """Writes and reads one rank's checkpoints of a job."""

    loaded: LoadedConfig
    rank: int
    sharded: bool
    """A ``[parallel]`` layout: every rank writes and reads its shards."""

    def save(self, state: CheckpointState) -> tuple[Path | None, dict[str, Any] | None]:
        """Add ``state`` to the job's checkpoints as the newest (a collective when sharded).

        Returns the checkpoint's path (None on the ranks of a plain job that write nothing) and, on the
        rank that wrote a whole-model file, its content in memory (live tensors: the file's content only
        until they change).
        """
        store = checkpoint_store(self.loaded)
        if self.sharded:
            return save_layout_checkpoint(store, state), None
        if self.rank != 0:
            return None, None
        payload, path = save_checkpoint(store, state)
        return path, payload

    def restore(
        self,
        resume: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        written: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], Progress]:
        """Load ``resume`` into the model, optimizer and LR scheduler (a collective when sharded); its payload
        and progress. ``written``: a whole-model checkpoint as this process wrote it, instead of the file."""
        live = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if self.sharded:
            return restore_layout_checkpoint(resume, **live)
        payload = written if written is not None else read_checkpoint(resume)
        return payload, restore_checkpoint(payload, resume, **live)
