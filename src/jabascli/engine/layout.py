"""Where a job's files go: its checkpoint and its run folder (metrics, trainer logs)."""

from __future__ import annotations

from pathlib import Path

from jabascli.config import LoadedConfig


def checkpoint_path(loaded: LoadedConfig) -> Path:
    """``[storage] checkpoint_dir / <job name> / checkpoint.pt``: the latest checkpoint, replaced atomically."""
    cfg = loaded.config
    return cfg.storage.checkpoint_dir / cfg.job.name / "checkpoint.pt"


def run_folder(loaded: LoadedConfig) -> Path:
    """``[storage] run_dir / <job name>``: metrics (CSV, JSONL, TensorBoard) and ``logs/rank<R>.log``."""
    cfg = loaded.config
    return cfg.storage.run_dir / cfg.job.name
