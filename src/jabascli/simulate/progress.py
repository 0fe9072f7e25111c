"""Statistical progress, efficiency and the validation metric, read off a trace.

Pollux's model of training progress (Qiao et al., OSDI 2021), with its trace
conventions:

- ``M0`` is the smallest traced GBS; progress is counted in iterations at ``M0``.
- One iteration at GBS ``M`` advances progress by ``E(M) * M / M0``, with the
  statistical efficiency

      E(M) = (grad_var + grad_sqr) / (grad_var + (M / M0) * grad_sqr)
           = (B_noise + M0) / (B_noise + M),   B_noise = M0 * grad_var / grad_sqr

  (AdaptDL ``goodput.py``: ``gain / scale``). ``grad_sqr`` estimates |G|^2 and
  ``grad_var`` the gradient variance at ``M0``; ``B_noise`` is the gradient noise
  scale.
- The trace has one row per epoch; epoch ``k`` ends at progress
  ``boundaries[k]`` = the smallest traced progress of row ``k`` over the batch
  sizes (Pollux ``get_progress``). During epoch ``k`` the statistics are row
  ``k``'s, linearly interpolated between the traced batch sizes at the current GBS
  and clamped to the traced range (Pollux ``get_grad_stats``).
- The metric after epoch ``k`` is the best traced metric of rows ``0..k``,
  interpolated the same way (Pollux ``get_best_metric``); it rises if the first
  traced run's last row is above its first.

What a run really gains per iteration is what it credited: the trace logs, per
epoch of the run at GBS ``B``, its progress and its iterations, so

    gain_B[k] = (progress_B[k] - progress_B[k-1]) / (iteration_B[k] - iteration_B[k-1])

is the progress per iteration AdaptDL accumulated from its per-step estimates.
The row's statistics give ``E(B) * B / M0``, which matches it within 1% in most
epochs after the first (2-7% off in a few early ones at the largest GBS) but
not in the first: there the gradient norm falls by 5-20x and the row's
statistics give far less than was credited (imagenet at 6400: 3.8 against 11.6
per iteration; the next row gives 7.2, and any blend of two rows gives a gain
between theirs, so no reading of the rows reproduces it; docs/simulation.md).
The simulated truth is therefore the formula times the *credit* of the epoch,

    credit_B[k] = gain_B[k] / (E_k(B) * B / M0),

interpolated linearly between the traced batch sizes like the statistics. At a
traced GBS a fixed-batch run then needs the iterations the real run logged; the
policies still see only the statistics (:meth:`Statistics.efficiency`), as a
running AdaptDL job does.
"""

from __future__ import annotations

import numpy as np

from jabascli.errors import InputError
from jabascli.simulate.trace import ValidationRun


def efficiency(
    gbs: np.ndarray | float, m0: float, grad_sqr: np.ndarray | float, grad_var: np.ndarray | float
) -> np.ndarray | float:
    """Pollux's statistical efficiency ``E(M)`` (formula in the module docstring)."""
    return (grad_var + grad_sqr) / (grad_var + (np.asarray(gbs, dtype=float) / m0) * grad_sqr)


class Statistics:
    """A trace's gradient statistics, epoch boundaries and metric as functions of GBS and epoch."""

    def __init__(self, validation: dict[int, ValidationRun]) -> None:
        runs = [validation[b] for b in sorted(validation)]
        self.batch_sizes = np.array([r.batch_size for r in runs], dtype=float)
        self.m0 = float(self.batch_sizes[0])
        self.max_gbs = float(self.batch_sizes[-1])
        self.epochs = min(len(r.progress) for r in runs)
        n = self.epochs
        self.boundaries = np.min([r.progress[:n] for r in runs], axis=0)
        self._sqr = np.array([r.grad_sqr[:n] for r in runs])  # [batch size, epoch]
        self._var = np.array([r.grad_var[:n] for r in runs])
        self.metric_rises = bool(runs[0].metric[-1] > runs[0].metric[0])
        metric = np.array([r.metric[:n] for r in runs])
        self._best = (
            np.maximum.accumulate(metric, axis=1) if self.metric_rises else np.minimum.accumulate(metric, axis=1)
        )
        self.iterations = {r.batch_size: r.iteration[:n] for r in runs}
        credited = np.array(
            [np.diff(r.progress[:n], prepend=0.0) / np.diff(r.iteration[:n], prepend=0.0) for r in runs]
        )
        formula = np.array(
            [efficiency(r.batch_size, self.m0, r.grad_sqr[:n], r.grad_var[:n]) * r.batch_size / self.m0 for r in runs]
        )
        self._credit = credited / formula  # [batch size, epoch]

    def epoch_progress(self, epoch: int) -> float:
        """Progress made during ``epoch`` (from the previous boundary to its own)."""
        start = self.boundaries[epoch - 1] if epoch > 0 else 0.0
        return float(self.boundaries[epoch] - start)

    def grad_stats(self, gbs: np.ndarray | float, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(grad_sqr, grad_var)`` during ``epoch`` at GBS ``gbs`` (scalar or array)."""
        return (
            np.interp(gbs, self.batch_sizes, self._sqr[:, epoch]),
            np.interp(gbs, self.batch_sizes, self._var[:, epoch]),
        )

    def noise_scale(self, gbs: float, epoch: int) -> float:
        sqr, var = self.grad_stats(gbs, epoch)
        return float(self.m0 * var / sqr)

    def efficiency(self, gbs: np.ndarray | float, epoch: int, stats_gbs: float | None = None) -> np.ndarray | float:
        """``E(gbs)`` in ``epoch``, with the statistics measured at ``stats_gbs`` (default: ``gbs``).

        A running job measures its statistics at the GBS it runs; a policy then
        extrapolates ``E`` to other GBS from that one measurement, as AdaptDL does.
        """
        sqr, var = self.grad_stats(gbs if stats_gbs is None else stats_gbs, epoch)
        return efficiency(gbs, self.m0, sqr, var)

    def credit(self, gbs: np.ndarray | float, epoch: int) -> np.ndarray | float:
        """The credited gain over the formula's in ``epoch`` at GBS ``gbs`` (module docstring)."""
        return np.interp(gbs, self.batch_sizes, self._credit[:, epoch])

    def gain(self, gbs: np.ndarray | float, epoch: int) -> np.ndarray | float:
        """True progress per iteration in ``epoch`` at GBS ``gbs``: ``E(gbs) * gbs / M0 * credit``."""
        return self.efficiency(gbs, epoch) * np.asarray(gbs, dtype=float) / self.m0 * self.credit(gbs, epoch)

    def best_metric(self, gbs: float, epoch: int) -> float:
        """The best validation metric seen by the end of ``epoch`` at GBS ``gbs``."""
        return float(np.interp(gbs, self.batch_sizes, self._best[:, epoch]))

    def reached(self, metric: float, target: float) -> bool:
        return metric >= target if self.metric_rises else metric <= target

    def target_epoch(self, target: float) -> int:
        """The epoch by whose end the traced runs reach ``target``: the median over the runs that do.

        What a user who sets a target knows from earlier runs of the job (Pollux and
        Sia take a job's length to its target from its reference runs); the runs at
        different GBS reach it in different epochs (cifar10's 0.94: epochs 65 to 83),
        so the (lower) median, not the one the job will run at.
        """
        reached = self._best >= target if self.metric_rises else self._best <= target
        first = [int(np.argmax(row)) for row in reached if row.any()]
        if not first:
            self.check_target(target)
        return int(np.sort(first)[(len(first) - 1) // 2])  # the lower median

    def check_target(self, target: float) -> None:
        """Raise :class:`InputError` if no traced run ever reaches ``target``."""
        best = float(self._best[:, -1].max() if self.metric_rises else self._best[:, -1].min())
        if not self.reached(best, target):
            word = "highest" if self.metric_rises else "lowest"
            raise InputError.at(
                None, "target_metric", f"{target:g} is never reached in the trace (its {word} is {best:g})"
            )
