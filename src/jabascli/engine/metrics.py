"""Training metrics on disk: CSV, JSON lines and TensorBoard scalars (rank 0 only).

In the run folder (``[storage] run_dir / <job name>``):

* ``steps.csv``: ``time, epoch, step, gbs, loss, samples_per_s, lr, iteration_s``,
  one row per logged step (a few per second at most): ``loss`` and
  ``samples_per_s`` are averaged over the steps since the previous row,
  ``iteration_s`` is their median duration (what a performance model's
  prediction is compared with: a median, as the profiles' times are);
* ``busy.csv``: ``time, step, rank, busy_s``, with each ``steps.csv`` row a row per rank: the rank's
  median busy time over the same steps (:mod:`jabascli.engine.busy`: its computation up to its last
  gradient bucket, before it waits for the others), which the online performance model fits each
  server's computation to;
* ``epochs.csv``: ``epoch, step, train_loss, val_loss, val_accuracy, samples_per_s, time_s``;
* ``changes.csv``: ``step, gbs, lr``: the GBS and LR that iteration ``step`` trained
  with, one row each time either changes (and at the start of each attempt), so
  plots show a change at the iteration it took effect, not at the next logged row;
* ``adjustments.csv``: one row per adaptive-batching decision (adaptive jobs only):
  the metrics measured, old and new GBS, LBS and plan, LR factor and LR, why;
* ``metrics.jsonl``: every row of these, as ``{"kind": "step" | "epoch" | "adjustment", ...}``;
* ``tensorboard/attempt-<N>/`` (one folder per run attempt, so TensorBoard shows each as a run):
  ``train/loss``, ``train/samples_per_s``, ``train/gbs``,
  ``train/lr``, ``train/iteration_s``, ``val/loss``, ``val/accuracy``, and for adaptive jobs
  ``adaptive/gbs``, ``adaptive/similarity``, ``adaptive/noise_scale``, ``adaptive/lr``, ``adaptive/lr_factor``,
  against the step.

Files are never truncated: every attempt at the job (a rerun resuming it, a
restart after a failure) appends to the CSV and JSON lines files, so rows of
steps that an interrupted attempt trained past its last checkpoint stay, and
the resumed attempt writes those steps again after them (the later row of a
step is the one that counts). ``jabas run --fresh`` moves the old run folder aside
instead. Rows are written whole and flushed one by one, so a killed trainer
leaves complete lines.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_FIELDS = ("time", "epoch", "step", "gbs", "loss", "samples_per_s", "lr", "iteration_s")
BUSY_FIELDS = ("time", "step", "rank", "busy_s")
CHANGE_FIELDS = ("step", "gbs", "lr")
EPOCH_FIELDS = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "samples_per_s", "time_s")
ADJUSTMENT_FIELDS = (
    "time", "epoch", "position", "step", "metric", "similarity", "noise_scale", "target_gbs", "old_gbs", "new_gbs",
    "old_lbs", "new_lbs", "plan", "lr_factor", "lr", "changed", "reason", "source", "overhead_s",
)  # fmt: skip


@dataclass(frozen=True)
class EpochResult:
    """One epoch of training, as rank 0 reports it (a row of ``epochs.csv``)."""

    epoch: int
    step: int
    train_loss: float | None
    val_loss: float | None
    val_accuracy: float | None
    samples_per_s: float
    time_s: float


class MetricsWriter:
    def __init__(self, folder: Path, *, tensorboard: bool = True) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        mode = "a"  # never truncate what an earlier attempt wrote
        self._steps = self._open_csv("steps.csv", STEP_FIELDS, mode)
        self._epochs = self._open_csv("epochs.csv", EPOCH_FIELDS, mode)
        self._adjustments: tuple[Any, Any] | None = None  # adjustments.csv, opened at the first adjustment
        self._busy: tuple[Any, Any] | None = None  # busy.csv, opened at the first busy times
        self._changes = self._open_csv("changes.csv", CHANGE_FIELDS, mode)
        self._setting: tuple[int, float | None] | None = None
        self._mode = mode
        self._jsonl = (folder / "metrics.jsonl").open(mode, encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(next_attempt_folder(folder / "tensorboard")))

    def _open_csv(self, name: str, fields: tuple[str, ...], mode: str) -> tuple[Any, Any]:
        path = self.folder / name
        new = not path.exists() or path.stat().st_size == 0
        f = path.open(mode, encoding="utf-8", newline="")
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
            f.flush()
        return f, writer

    def step(
        self,
        *,
        epoch: int,
        step: int,
        gbs: int,
        loss: float,
        samples_per_s: float,
        lr: float | None,
        iteration_s: float | None = None,
    ) -> None:
        row = {"time": round(time.time(), 3), "epoch": epoch, "step": step, "gbs": gbs, "loss": loss}
        row.update(samples_per_s=samples_per_s, lr=lr, iteration_s=iteration_s)
        self._write(self._steps, "step", row)
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/samples_per_s", samples_per_s, step)
            self._tb.add_scalar("train/gbs", gbs, step)
            if lr is not None:
                self._tb.add_scalar("train/lr", lr, step)
            if iteration_s is not None:
                self._tb.add_scalar("train/iteration_s", iteration_s, step)

    def busy(self, *, step: int, busy_s: dict[int, float]) -> None:
        """Each rank's median busy time over the steps up to ``step`` since the last row: a ``busy.csv`` row each
        (not in ``metrics.jsonl``: one row per rank, a few per second)."""
        if self._busy is None:
            self._busy = self._open_csv("busy.csv", BUSY_FIELDS, self._mode)
        f, writer = self._busy
        now = round(time.time(), 3)
        for rank, seconds in sorted(busy_s.items()):
            writer.writerow({"time": now, "step": step, "rank": rank, "busy_s": round(seconds, 7)})
        f.flush()

    def settings(self, *, step: int, gbs: int, lr: float | None) -> None:
        """The GBS and LR iteration ``step`` trains with: a ``changes.csv`` row when they differ from the last."""
        if (gbs, lr) == self._setting:
            return
        self._setting = (gbs, lr)
        f, writer = self._changes
        writer.writerow({"step": step, "gbs": gbs, "lr": lr})
        f.flush()

    def epoch(self, row: dict[str, Any]) -> None:
        self._write(self._epochs, "epoch", row)
        if self._tb is not None:
            for key, tag in (("val_loss", "val/loss"), ("val_accuracy", "val/accuracy")):
                if row.get(key) is not None:
                    self._tb.add_scalar(tag, row[key], row["step"])
            self._tb.flush()

    def adjustment(self, row: dict[str, Any], *, lr: float | None) -> None:
        """One adaptive-batching decision (``jabascli.adaptive.batching``): ``adjustments.csv`` and TensorBoard."""
        if self._adjustments is None:
            self._adjustments = self._open_csv("adjustments.csv", ADJUSTMENT_FIELDS, self._mode)
        self._write(self._adjustments, "adjustment", {"time": round(time.time(), 3), **row, "lr": lr})
        if self._tb is not None:
            step = row["step"]
            self._tb.add_scalar("adaptive/gbs", row["new_gbs"], step)
            for key in ("similarity", "noise_scale", "lr_factor"):
                if row.get(key) is not None:
                    self._tb.add_scalar(f"adaptive/{key}", row[key], step)
            if lr is not None:
                self._tb.add_scalar("adaptive/lr", lr, step)

    def _write(self, target: tuple[Any, Any], kind: str, row: dict[str, Any]) -> None:
        f, writer = target
        writer.writerow(row)
        f.flush()
        self._jsonl.write(json.dumps({"kind": kind, **row}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        for f in (self._steps[0], self._epochs[0], self._changes[0], self._jsonl):
            f.close()
        for extra in (self._adjustments, self._busy):
            if extra is not None:
                extra[0].close()
        if self._tb is not None:
            self._tb.close()


def next_attempt_folder(parent: Path) -> Path:
    """``parent/attempt-<N>``, N one more than the highest there (1 for the first)."""
    numbers = [int(p.name.split("-", 1)[1]) for p in parent.glob("attempt-*") if p.name.split("-", 1)[1].isdigit()]
    return parent / f"attempt-{max(numbers, default=0) + 1}"


def median_iteration_s(steps_csv: Path, first_step: int = 0, warmup: int = 5) -> tuple[float, int] | None:
    """Median iteration time (s) of a run in ``steps.csv``, and how many iterations it covers.

    The run began after step ``first_step`` (a resumed run appends to the
    file); its first ``warmup`` iterations are left out. Each row's
    ``iteration_s`` (the median of the iterations since the row before)
    counts once per iteration it covers after the warm-up (a row can cover
    most of a short run: its median stands for them, warm-up ones among them
    or not). None when no row is left.
    """
    return _covered_medians(steps_csv, "iteration_s", first_step, warmup).get(None)


def median_busy_s(busy_csv: Path, first_step: int = 0, warmup: int = 5) -> dict[int, float]:
    """Each rank's median busy time (s) of a run in ``busy.csv``, its rows counted as :func:`median_iteration_s`
    counts ``steps.csv``'s; empty when the file is missing or holds nothing of the run."""
    return {rank: median for rank, (median, _) in _covered_medians(busy_csv, "busy_s", first_step, warmup).items()}


def _covered_medians(path: Path, column: str, first_step: int, warmup: int) -> dict[Any, tuple[float, int]]:
    """Per ``rank`` column value (None where the file has none): the median of ``column``, each row counted once
    per iteration it covers after step ``first_step + warmup``, and how many iterations that is."""
    import statistics

    times: dict[Any, list[float]] = {}
    previous: dict[Any, int] = {}
    try:
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                key = int(row["rank"]) if "rank" in row else None
                step = int(row["step"])
                covered = step - max(previous.get(key, 0), first_step + warmup)
                previous[key] = step
                if covered > 0 and row.get(column):
                    times.setdefault(key, []).extend([float(row[column])] * covered)
    except (OSError, ValueError, KeyError):
        return {}
    return {key: (statistics.median(t), len(t)) for key, t in times.items() if t}


def open_metrics(folder: Path, rank: int, enabled: bool = True) -> MetricsWriter | None:
    """Rank 0's metrics writer in the run folder ``folder`` (None on the other ranks, or with metrics off)."""
    return MetricsWriter(folder) if rank == 0 and enabled else None
