"""The options of a training run, beyond the config, and how they reach trainer processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_BUCKET_CAP_MB = 25.0
"""DDP's default gradient bucket size."""
DEFAULT_FIRST_BUCKET_MB = 1.0
"""With its default cap (none given), DDP keeps the first bucket this small, so communication starts early."""


@dataclass(frozen=True)
class TrainOptions:
    plan: Path | None = None
    """A plan file; default ``[job] plan``, else the config's servers."""
    resume: Path | None = None
    """A checkpoint to continue from (any world size or per-rank configuration)."""
    checkpoint_every: int | None = None
    """Also checkpoint every this many iterations (a checkpoint is always written at each epoch end and at exit)."""
    max_steps: int | None = None
    """Stop after this many iterations in total (counting those before a resume)."""
    bucket_cap_mb: float | None = None
    """DDP's gradient bucket size; None: DDP's default (25 MiB, and a first bucket of 1 MiB), as the
    bucket profiler measures it. (PyTorch drops the small first bucket whenever a cap is given, even 25.)"""
    metrics: bool = True
    """Write CSV, JSONL and TensorBoard metrics in the run folder (rank 0)."""

    def train_args(self) -> list[str]:
        """The ``jabas train`` options that pass these on to a trainer process."""
        args = [] if self.bucket_cap_mb is None else ["--bucket-cap-mb", repr(self.bucket_cap_mb)]
        for flag, path in (("--plan", self.plan), ("--resume", self.resume)):
            if path is not None:
                args += [flag, str(Path(path).resolve())]
        for flag, number in (("--checkpoint-every", self.checkpoint_every), ("--max-steps", self.max_steps)):
            if number is not None:
                args += [flag, str(number)]
        if not self.metrics:
            args.append("--no-metrics")
        return args
