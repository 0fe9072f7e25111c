"""What a trainer's process keeps across a move in place: the workload, its datasets and loader workers.

None of it depends on the plan or the world; nor does a freshly built model, which a survivor of a lost
peer builds ahead while its recovery order travels (:func:`fresh_model`). A node's warm trainer server
(:mod:`jabascli.cli.spare`) prepares them before it forks any trainer (:func:`prepare_inputs`), so that a
rank started for a move has its data before the move happens rather than during it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from jabascli.config import LoadedConfig
from jabascli.engine.loader import MicroBatchFeed
from jabascli.workload import Workload, workload_of


@dataclass(frozen=True)
class Inputs:
    """What a trainer's process keeps across a move in place: none of it depends on the plan or the world."""

    workload: Workload
    train_set: Any
    val_set: Any
    feed: MicroBatchFeed | None
    """The loader workers (persistent processes), or None when loading in the trainer."""
    model: torch.nn.Module | None = None
    """The next trainer's model, built ahead by :func:`fresh_model` (its state is restored next); None: the
    trainer builds it."""


def fresh_model(workload: Workload, seed: int, device: torch.device) -> torch.nn.Module:
    """The workload's model as a trainer builds it: the global RNG seeded with the job's seed first, so that
    the RNG stands where building leaves it whichever of the two built it."""
    torch.manual_seed(seed)
    return workload.build_model().to(device)


_prepared: tuple[tuple[str, ...], Inputs] | None = None


def _job_key(loaded: LoadedConfig) -> tuple[str, ...]:
    job = loaded.config.job
    return (str(job.workload), json.dumps(job.options, sort_keys=True, default=str), str(job.data))


def prepare_inputs(loaded: LoadedConfig) -> None:
    """Load the job's workload and datasets now, for the trainers forked from this process later.

    A node's warm trainer server (:mod:`jabascli.cli.spare`) calls it, so that a rank
    started for a move has its data before the move happens rather than during it.
    """
    global _prepared
    workload = workload_of(loaded)
    _prepared = (_job_key(loaded), Inputs(workload, workload.train_dataset(), workload.val_dataset(), None))


def take_prepared(loaded: LoadedConfig) -> Inputs | None:
    global _prepared
    prepared, _prepared = _prepared, None
    return prepared[1] if prepared is not None and prepared[0] == _job_key(loaded) else None
