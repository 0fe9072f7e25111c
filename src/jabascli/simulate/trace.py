"""Reading a trace folder of public training measurements (Sia/Pollux format).

A trace folder (for example ``../shared/reference/sia-traces/imagenet``) holds, per
GPU type ``<type>``:

- ``placements-<type>.csv``: ``local_bsz, step_time, sync_time, placement``; one
  data-parallel iteration in seconds at a local batch size (LBS) per GPU, for a
  placement written as a digit string of GPUs per node (``12`` = one node with 1
  GPU and one with 2); ``sync_time`` is the gradient synchronisation part of it;
- ``scalability-<type>.csv``: the same by ``num_nodes`` and ``num_replicas``;

and, for the job, ``validation-<B>.csv``: one row per epoch of a real run at
global batch size (GBS) ``B`` with ``progress, iteration, metric, grad_sqr,
grad_var`` (see ``progress.py`` for what they mean).

This module only turns the files into arrays and checks them; interpolation lives
in ``steptime.py`` (iteration time) and ``progress.py`` (statistics and metric).
Every problem is an :class:`~jabascli.errors.InputError` naming the file.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jabascli.errors import InputError
from jabascli.inputs import read_text

# GPUs per node of each traced machine (the trace's NOTICE.md).
GPUS_PER_NODE: dict[str, int] = {"aws": 4, "azure": 8, "dgx": 8, "dgx-ext": 8, "quad": 4, "rtx": 8}

# Checkpoint-restart cost per job in seconds, as the Pollux and Sia simulators charge it.
RESTART_S: dict[str, float] = {"imagenet": 250.0, "cifar10": 50.0, "bert": 120.0}
DEFAULT_RESTART_S = 30.0  # Sia's value for a job it has no figure for

PLACEMENT_COLUMNS = ("placement", "local_bsz", "step_time", "sync_time")
SCALABILITY_COLUMNS = ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")
VALIDATION_COLUMNS = ("progress", "iteration", "metric", "grad_sqr", "grad_var")
_VALIDATION_NAME = re.compile(r"^validation-(\d+)\.csv$")


@dataclass(frozen=True)
class ValidationRun:
    """One traced run at a fixed GBS: arrays with one entry per epoch (row)."""

    batch_size: int
    progress: np.ndarray
    iteration: np.ndarray
    metric: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray


@dataclass(frozen=True)
class TimingRows:
    """The step-time rows of one GPU type, as read (placement strings kept)."""

    gpu_type: str
    placement: list[str]  # digit strings from placements-<type>.csv
    placement_lbs: np.ndarray
    placement_step: np.ndarray
    placement_sync: np.ndarray
    scal_nodes: np.ndarray  # rows of scalability-<type>.csv
    scal_replicas: np.ndarray
    scal_lbs: np.ndarray
    scal_step: np.ndarray
    scal_sync: np.ndarray


@dataclass(frozen=True)
class Trace:
    """A job's trace: its validation runs and the timing rows of the GPU types read."""

    name: str
    path: Path
    validation: dict[int, ValidationRun]  # by GBS, ascending
    timings: dict[str, TimingRows] = field(default_factory=dict)

    @property
    def restart_s(self) -> float:
        return RESTART_S.get(self.name, DEFAULT_RESTART_S)

    @property
    def batch_sizes(self) -> list[int]:
        return list(self.validation)


def _read_csv(path: Path, columns: tuple[str, ...]) -> dict[str, list[str]]:
    text = read_text(path, what="trace file")
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in columns if c not in header]
    if missing:
        raise InputError.at(path, None, f"missing column(s) {', '.join(missing)}; expected {', '.join(columns)}")
    out: dict[str, list[str]] = {c: [] for c in columns}
    for row in reader:
        for c in columns:
            out[c].append((row.get(c) or "").strip())
    if not out[columns[0]]:
        raise InputError.at(path, None, "no rows")
    return out


def _numbers(path: Path, column: str, values: list[str]) -> np.ndarray:
    try:
        arr = np.array([float(v) for v in values])
    except ValueError:
        bad = next(i for i, v in enumerate(values) if not _is_number(v))
        raise InputError.at(path, f"line {bad + 2}", f"{column} {values[bad]!r} is not a number") from None
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise InputError.at(path, f"line {bad + 2}", f"{column} is not finite")
    return arr


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_validation(trace_dir: Path) -> dict[int, ValidationRun]:
    """All ``validation-<B>.csv`` files of a trace folder, by GBS."""
    if not trace_dir.is_dir():
        raise InputError.at(trace_dir, None, "trace folder not found")
    runs: dict[int, ValidationRun] = {}
    for path in sorted(trace_dir.iterdir()):
        match = _VALIDATION_NAME.match(path.name)
        if not match:
            continue
        cols = _read_csv(path, VALIDATION_COLUMNS)
        arrays = {c: _numbers(path, c, cols[c]) for c in VALIDATION_COLUMNS}
        if np.any(np.diff(arrays["progress"]) <= 0):
            raise InputError.at(path, "progress", "must increase from row to row")
        if np.any(np.diff(arrays["iteration"], prepend=0.0) <= 0):
            raise InputError.at(path, "iteration", "must be > 0 and increase from row to row")
        if np.any(arrays["grad_sqr"] <= 0) or np.any(arrays["grad_var"] < 0):
            raise InputError.at(path, "grad_sqr/grad_var", "grad_sqr must be > 0 and grad_var >= 0")
        batch = int(match.group(1))
        runs[batch] = ValidationRun(batch_size=batch, **arrays)
    if not runs:
        raise InputError.at(trace_dir / "validation-<B>.csv", None, "no validation runs found (see the NOTICE)")
    return dict(sorted(runs.items()))


def read_timings(trace_dir: Path, gpu_type: str) -> TimingRows:
    """The placements and scalability rows of one GPU type."""
    p_path = trace_dir / f"placements-{gpu_type}.csv"
    s_path = trace_dir / f"scalability-{gpu_type}.csv"
    p = _read_csv(p_path, PLACEMENT_COLUMNS)
    s = _read_csv(s_path, SCALABILITY_COLUMNS)
    for i, text in enumerate(p["placement"]):
        if not text.isdigit() or "0" in text:
            raise InputError.at(p_path, f"line {i + 2}", f"placement {text!r} is not a string of GPUs per node (1-9)")
    rows = TimingRows(
        gpu_type=gpu_type,
        placement=list(p["placement"]),
        placement_lbs=_numbers(p_path, "local_bsz", p["local_bsz"]),
        placement_step=_numbers(p_path, "step_time", p["step_time"]),
        placement_sync=_numbers(p_path, "sync_time", p["sync_time"]),
        scal_nodes=_numbers(s_path, "num_nodes", s["num_nodes"]),
        scal_replicas=_numbers(s_path, "num_replicas", s["num_replicas"]),
        scal_lbs=_numbers(s_path, "local_bsz", s["local_bsz"]),
        scal_step=_numbers(s_path, "step_time", s["step_time"]),
        scal_sync=_numbers(s_path, "sync_time", s["sync_time"]),
    )
    for path, step, sync in (
        (p_path, rows.placement_step, rows.placement_sync),
        (s_path, rows.scal_step, rows.scal_sync),
    ):
        if np.any(step <= 0) or np.any(sync < 0) or np.any(sync > step):
            raise InputError.at(path, "step_time/sync_time", "expected 0 <= sync_time <= step_time and step_time > 0")
    return rows


def load_trace(trace_dir: Path | str, gpu_types: list[str] | tuple[str, ...] = ()) -> Trace:
    """Read a trace folder: its validation runs and the timing rows of ``gpu_types``.

    A GPU type not in :data:`GPUS_PER_NODE` or a file the NOTICE names that is
    missing raises :class:`InputError` naming it.
    """
    trace_dir = Path(trace_dir)
    validation = read_validation(trace_dir)
    timings: dict[str, TimingRows] = {}
    for gpu_type in gpu_types:
        if gpu_type not in GPUS_PER_NODE:
            raise InputError.at(
                None, "cluster", f"unknown GPU type {gpu_type!r}; expected one of {', '.join(GPUS_PER_NODE)}"
            )
        timings[gpu_type] = read_timings(trace_dir, gpu_type)
    return Trace(name=trace_dir.resolve().name, path=trace_dir, validation=validation, timings=timings)
