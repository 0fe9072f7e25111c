"""jabas's view of the coming epochs: the noise scale forecast, and each allocation's rate at it.

A running job measures the gradient noise scale ``B_noise = M0 * grad_var /
grad_sqr`` once per epoch (at the GBS it runs). With the efficiency
``E(M) = (B_noise + M0) / (B_noise + M)``, an allocation's best progress rate is
a function of ``B_noise`` alone:

    R(B_noise) = max over its IIDP configurations (M, iter_s) of  E(M) * M / M0 / iter_s

(:class:`RateCurve`, tabulated once on a log grid). The noise scale grows as
training proceeds (the premise of adaptive batching), so the time to finish the
job is predicted with the noise scale forecast for every remaining epoch by the
damped trend on ``log B_noise`` that forecasts jabas's GBS trajectory
(``autoscale/forecast.py:damped_holt``; with fewer than three measurements, the
last one), rather than with the last measurement held for the rest of the job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jabascli.autoscale.forecast import damped_holt
from jabascli.simulate.configs import Frontier

# The tabulated range of B_noise; outside it R is nearly flat (E ~ 1 or ~ B_noise/M).
GRID = np.geomspace(1e-2, 1e8, 321)


class RateCurve:
    """``R(B_noise)`` of one allocation (module docstring), interpolated in ``log B_noise``."""

    def __init__(self, frontier: Frontier, m0: float) -> None:
        # Only configurations no other beats in both GBS and time can be best at some noise scale.
        order = np.lexsort((frontier.iter_s, -frontier.gbs))  # GBS descending, then faster first
        gbs, iter_s = frontier.gbs[order], frontier.iter_s[order]
        keep = iter_s < np.minimum.accumulate(np.concatenate([[np.inf], iter_s[:-1]]))
        gbs, iter_s = gbs[keep], iter_s[keep]
        efficiency = (GRID[:, None] + m0) / (GRID[:, None] + gbs[None, :])
        self._rate = (efficiency * (gbs / m0 / iter_s)[None, :]).max(axis=1)
        self._log_grid = np.log(GRID)

    def __call__(self, noise: np.ndarray) -> np.ndarray:
        return np.interp(np.log(np.clip(noise, GRID[0], GRID[-1])), self._log_grid, self._rate)


def noise_scales(measured: Sequence[float], horizon: int) -> np.ndarray:
    """The noise scale of each of the next ``horizon`` epochs, from one measurement per epoch so far."""
    return damped_holt(np.asarray(measured, dtype=float), horizon)
