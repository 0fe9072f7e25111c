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


class ForecastError:
    """How far the noise-scale forecast has been off, one epoch ahead, in this run so far.

    Each epoch's forecast of the next epoch's noise scale ``F`` is compared with
    the measurement ``B`` when it arrives; the uncertainty is the root mean square
    of ``log(B / F)``:

        sigma = sqrt(mean_k log(B_k / F_k)^2)

    over the damped trend's forecasts once one has been scored, and until then
    over the forecasts made while the statistics were unsettled (the last
    measurement held: the first epochs' jumps, the only evidence yet); 0 before
    any. The planner's margin holds a move to this band (``planner.choose_allocation``):
    the noise scale of the coming epochs may be ``exp(+-sigma)`` times its forecast.
    """

    def __init__(self) -> None:
        self._errors: dict[bool, list[float]] = {True: [], False: []}  # by trend (settled) or not
        self._pending: tuple[int, float, bool] | None = None

    def forecast(self, row: int, value: float, trend: bool) -> None:
        """The forecast made now of the noise scale of trace row ``row`` (``trend``: by the damped trend)."""
        self._pending = (row, value, trend)

    def measured(self, row: int, value: float) -> None:
        """A measurement of row ``row``: scored against its forecast, if one was made."""
        if self._pending is not None and self._pending[0] == row:
            self._errors[self._pending[2]].append(float(np.log(value / self._pending[1])))
            self._pending = None

    @property
    def sigma(self) -> float:
        errors = self._errors[True] or self._errors[False]
        return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


# Measurements before the noise scale is trusted: the damped trend needs three.
SETTLE_MEASUREMENTS = 3
SCENARIOS = 9
# The band's top, in units of the largest GBS: at B_noise = 4 * M_max the largest
# GBS keeps E(M_max) ~ 0.8 of its samples' worth, the most a user asks of it.
CEILING_OVER_MAX_GBS = 4.0


def settled(measured: Sequence[float]) -> bool:
    """Whether the noise scale has been measured in enough epochs for its forecast to be trusted."""
    return len(measured) >= SETTLE_MEASUREMENTS


def scenarios(noise: float, max_gbs: float) -> np.ndarray:
    """The noise scales an unsettled measurement ``noise`` may stand for, log-spaced.

    From ``noise`` up to ``CEILING_OVER_MAX_GBS * max_gbs``: the noise scale grows
    as training proceeds, and the first epochs' statistics understate it most
    (docs/simulation.md), so the band is one-sided.
    """
    return np.geomspace(noise, max(noise, CEILING_OVER_MAX_GBS * max_gbs), SCENARIOS)


def regret(rates_or_times: np.ndarray, higher_is_better: bool) -> np.ndarray:
    """Per row, the mean over the columns (scenarios) of ``log(value / best value of the column)``.

    The expected log-ratio to hindsight's choice under a log-uniform prior on the
    band: 0 for a row best in every scenario. The mean, not the worst case: the
    band's low end (the first measurement held for the whole job) never happens,
    and a worst-case rule lets it veto the allocations the rest of the job needs
    (CIFAR-10 on ``aws:2,rtx:1,azure:1``, docs/simulation.md).
    """
    if higher_is_better:
        return np.log(rates_or_times.max(axis=0)[None, :] / rates_or_times).mean(axis=1)
    return np.log(rates_or_times / rates_or_times.min(axis=0)[None, :]).mean(axis=1)


def robust_point(frontier: Frontier, m0: float, noises: np.ndarray) -> int:
    """The configuration of ``frontier`` of least :func:`regret` over the noise scales ``noises``.

    A point's rate at ``B_s``: ``r_i(s) = E_s(M_i) * M_i / M0 / iter_s_i``, with
    ``E_s(M) = (B_s + M0) / (B_s + M)``.
    """
    efficiency = (noises[None, :] + m0) / (noises[None, :] + frontier.gbs[:, None])
    rates = efficiency * (frontier.gbs / m0 / frontier.iter_s)[:, None]
    return int(np.argmin(regret(rates, higher_is_better=True)))
