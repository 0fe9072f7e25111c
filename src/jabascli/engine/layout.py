"""Where a job's files go: its checkpoints and its run folder (metrics, trainer logs)."""

from __future__ import annotations

from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.engine.checkpoint_store import CheckpointStore


def checkpoint_folder(loaded: LoadedConfig) -> Path:
    """``[storage] checkpoint_dir / <job name>``: the job's last checkpoints (engine/checkpoint_store.py)."""
    cfg = loaded.config
    return cfg.storage.checkpoint_dir / cfg.job.name


def checkpoint_store(loaded: LoadedConfig) -> CheckpointStore:
    return CheckpointStore(checkpoint_folder(loaded), loaded.config.storage.keep_checkpoints)


def run_folder(loaded: LoadedConfig) -> Path:
    """``[storage] run_dir / <job name>``: metrics (CSV, JSONL, TensorBoard) and ``logs/rank<R>.log``."""
    cfg = loaded.config
    return cfg.storage.run_dir / cfg.job.name
