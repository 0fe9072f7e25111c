"""Where a run of a job starts: from the job's newest intact checkpoint, unless told to start afresh.

A rerun continues the job, as torchtitan and Lightning do: ``jabas run`` resumes
from the newest intact checkpoint in ``[storage] checkpoint_dir / <job name>``
(:mod:`jabascli.engine.checkpoint_store`), and its metrics append to the run
folder. ``--fresh`` starts from scratch after moving the job's checkpoint and
run folders aside (renamed ``<job name>.<time>``; nothing is deleted), and
``--resume FILE`` resumes a given checkpoint. A job whose checkpoint has
already reached its last epoch, or ``--max-steps``, has nothing left to train.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.engine.checkpoint_store import newest_checkpoint
from jabascli.engine.layout import checkpoint_folder, run_folder
from jabascli.errors import InputError


@dataclass(frozen=True)
class Start:
    """How a run starts."""

    resume: Path | None
    """The checkpoint to resume (None: from scratch)."""
    step: int = 0
    epoch: int = 0
    done: str | None = None
    """Why nothing is left to train (the run should not start), or None."""
    notes: list[str] = field(default_factory=list)
    """Lines for the user: checkpoints passed over as corrupt, folders moved aside."""


def choose_start(loaded: LoadedConfig, *, resume: Path | None, fresh: bool, max_steps: int | None) -> Start:
    """Resume ``resume`` if given, else the job's newest intact checkpoint; ``fresh``: move the job aside first."""
    if fresh and resume is not None:
        raise InputError.at(None, "--fresh", "starts from scratch: it cannot be used with --resume")
    if fresh:
        return Start(None, notes=[f"moved {old} aside to {new}" for old, new in move_aside(loaded)])
    if resume is not None:
        return Start(resume)  # checked (and resolved, if a folder) by the launcher
    found = newest_checkpoint(checkpoint_folder(loaded))
    if found is None:
        return Start(None)
    step, epoch = found.entry.step, found.entry.epoch
    if step < 0:  # a checkpoint written before the manifest: its progress is in the payload
        from jabascli.engine.checkpoint import load_payload  # torch: only for such a checkpoint

        progress = load_payload(found.path, found.data)["progress"]
        step, epoch = progress["step"], progress["epoch"]
    notes = [f"{line}; resuming from {found.path}" for line in found.passed_over]
    epochs = loaded.config.job.epochs
    done = None
    if epoch >= epochs:
        done = f"the job has already trained its {epochs} epochs ({found.path}, step {step})"
    elif max_steps is not None and step >= max_steps:
        done = f"the job is already at step {step} ({found.path}), not below --max-steps {max_steps}"
    return Start(found.path, step, epoch, done, notes)


def move_aside(loaded: LoadedConfig) -> list[tuple[Path, Path]]:
    """Rename the job's checkpoint and run folders to ``<name>.<YYYYmmdd-HHMMSS>``; the pairs moved."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for folder in (checkpoint_folder(loaded), run_folder(loaded)):
        if not folder.exists():
            continue
        target = folder.with_name(f"{folder.name}.{stamp}")
        suffix = 1
        while target.exists():
            suffix += 1
            target = folder.with_name(f"{folder.name}.{stamp}-{suffix}")
        try:
            folder.rename(target)
        except OSError as exc:
            raise InputError.at(folder, None, f"cannot move it aside for --fresh: {exc.strerror or exc}") from None
        moved.append((folder, target))
    return moved
