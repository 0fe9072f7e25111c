"""Forecasting the GBS trajectory of the next epoch from the GBS history.

The adaptive batching policy changes the GBS once every ``adjust_interval``
iterations, so the history is one value per *adjustment point* and a forecast
is the values of the next ``horizon`` adjustment points. Three models:

* ``naive``: the last value, ``y[n + h] = y[n]``.
* ``seed``: the seed's ensemble as we read it (its code is not in the
  reference data), the mean of a Gaussian process regression of ``y`` on the
  point index (constant x RBF with a length scale of at most 3 points + white
  noise, normalised targets, scikit-learn) and simple exponential smoothing
  (``l = a y + (1 - a) l`` with ``a = 0.5``, forecast ``l``). Away from the
  data the GP returns to the history's mean and the smoothed level lags, so
  on a growing GBS it forecasts a *fall* (on the seed's growth case, 256 ->
  803 by +10 % per adjustment, it falls from 825 to 638 over the next epoch;
  the seed published 643; see ``docs/autoscaling.md``).
* ``holt``: damped Holt (additive trend) on ``log y``, i.e. a damped
  multiplicative trend, because the policy changes the GBS by a *ratio*
  (at most ``adjust_rate``) per adjustment::

      l[t] = a x[t] + (1 - a)(l[t-1] + phi b[t-1])
      b[t] = c (l[t] - l[t-1]) + (1 - c) phi b[t-1]
      x[n + h] = l[n] + (phi + phi^2 + ... + phi^h) b[n]

  ``(a, c, phi)`` are chosen from a small grid by the one-step-ahead squared
  error over the history.

``DEFAULT_MODEL`` is the one with the smallest measured error
(``tests/test_autoscale_forecast.py`` prints the table; ``docs/autoscaling.md``
states it). :func:`forecast` clamps to the GBS bounds and rounds to reachable
GBS (multiples of ``step``).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from jabascli.errors import InputError

Model = Callable[[np.ndarray, int], np.ndarray]
"""``model(history, horizon)``: the next ``horizon`` values, unclamped floats."""


def naive(history: np.ndarray, horizon: int) -> np.ndarray:
    return np.full(horizon, float(history[-1]))


def exponential_smoothing(history: np.ndarray, horizon: int, alpha: float = 0.5) -> np.ndarray:
    level = float(history[0])
    for y in history[1:]:
        level = alpha * float(y) + (1 - alpha) * level
    return np.full(horizon, level)


def gaussian_process(history: np.ndarray, horizon: int) -> np.ndarray:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    n = history.size
    if n < 3:
        return naive(history, horizon)
    x = np.arange(n, dtype=float).reshape(-1, 1)
    # A length scale of a few adjustment points: the GP follows the recent values and, beyond
    # them, returns to the history's mean (normalize_y), which is what makes the seed mean-revert.
    kernel = ConstantKernel(1.0) * RBF(length_scale=1.0, length_scale_bounds=(0.1, 3.0)) + WhiteKernel(1e-2)
    gp = GaussianProcessRegressor(kernel=kernel, normalize_y=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(x, history.astype(float))
    future = np.arange(n, n + horizon, dtype=float).reshape(-1, 1)
    return np.asarray(gp.predict(future), dtype=float)


def seed_ensemble(history: np.ndarray, horizon: int) -> np.ndarray:
    """The seed's forecast: the mean of the GP and the exponential smoothing forecasts."""
    return (gaussian_process(history, horizon) + exponential_smoothing(history, horizon)) / 2


HOLT_ALPHAS = (0.3, 0.5, 0.8, 1.0)
HOLT_BETAS = (0.1, 0.3, 0.6)
HOLT_PHIS = (0.8, 0.9, 0.98)


def _holt_run(x: np.ndarray, alpha: float, beta: float, phi: float) -> tuple[float, float, float]:
    """Filter ``x``; returns the final level, trend and the one-step-ahead squared error."""
    level, trend = float(x[0]), float(x[1] - x[0]) if x.size > 1 else 0.0
    sse = 0.0
    for value in x[1:]:
        predicted = level + phi * trend
        sse += (float(value) - predicted) ** 2
        new_level = alpha * float(value) + (1 - alpha) * predicted
        trend = beta * (new_level - level) + (1 - beta) * phi * trend
        level = new_level
    return level, trend, sse


def damped_holt(history: np.ndarray, horizon: int) -> np.ndarray:
    """Damped Holt on ``log(history)``, parameters fitted by one-step-ahead error (see the module doc)."""
    if history.size < 3:
        return naive(history, horizon)
    x = np.log(np.maximum(history.astype(float), 1e-9))
    best: tuple[float, float, float, float] | None = None  # sse, level, trend, phi
    for alpha, beta, phi in itertools.product(HOLT_ALPHAS, HOLT_BETAS, HOLT_PHIS):
        level, trend, sse = _holt_run(x, alpha, beta, phi)
        if best is None or sse < best[0] - 1e-12:
            best = (sse, level, trend, phi)
    assert best is not None
    _, level, trend, phi = best
    damping = np.cumsum(phi ** np.arange(1, horizon + 1))
    return np.exp(level + damping * trend)


MODELS: dict[str, Model] = {"naive": naive, "seed": seed_ensemble, "holt": damped_holt}
DEFAULT_MODEL = "holt"
"""Smallest measured error on the synthetic trajectories (see ``docs/autoscaling.md``)."""


def model_named(name: str) -> Model:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise InputError.at(None, "forecast model", f"expected one of {known}, got {name!r}") from None


def reachable(values: np.ndarray, lo: int, hi: int, step: int = 1) -> list[int]:
    """Each value clamped to ``[lo, hi]`` and rounded to the nearest multiple of ``step`` inside it."""
    if step < 1 or lo < 1 or hi < lo:
        raise InputError.at(None, "GBS bounds", f"expected 1 <= lo <= hi and step >= 1, got {lo}, {hi}, {step}")
    first = -(-lo // step) * step
    last = hi // step * step
    if first > last:
        raise InputError.at(None, "GBS bounds", f"no multiple of {step} lies in {lo}..{hi}")
    out = []
    for v in values:
        v = float(v) if math.isfinite(float(v)) else float(hi)
        out.append(int(min(max(round(v / step) * step, first), last)))
    return out


def forecast(
    history: Sequence[float],
    horizon: int,
    *,
    lo: int,
    hi: int,
    step: int = 1,
    model: str | Model = DEFAULT_MODEL,
) -> list[int]:
    """The GBS at each of the next ``horizon`` adjustment points, clamped and rounded to reachable GBS."""
    if not history:
        raise InputError.at(None, "GBS history", "is empty: nothing to forecast from")
    if horizon < 1:
        return []
    fn = model_named(model) if isinstance(model, str) else model
    return reachable(fn(np.asarray(history, dtype=float), horizon), lo, hi, step)


def horizon_for(dataset_size: int, adjust_interval: int, lo: int) -> int:
    """Adjustment points that can fall in one epoch: enough even if the GBS stays at its lower bound."""
    return max(1, math.ceil(dataset_size / (adjust_interval * lo)))


def rolling_error(model: str | Model, series: Sequence[float], horizon: int, *, warmup: int, lo: int, hi: int) -> float:
    """Mean absolute percentage error of ``horizon``-point forecasts from every origin after ``warmup`` points.

    From each origin ``n`` (``warmup <= n <= len - horizon``) the model sees
    ``series[:n]`` and forecasts ``series[n:n + horizon]``, clamped to ``[lo, hi]``
    and not rounded; the error is ``|forecast - truth| / truth`` averaged over
    every forecast point of every origin.
    """
    fn = model_named(model) if isinstance(model, str) else model
    truth_all = np.asarray(series, dtype=float)
    errors = []
    for n in range(warmup, truth_all.size - horizon + 1):
        predicted = np.clip(fn(truth_all[:n], horizon), lo, hi)
        truth = truth_all[n : n + horizon]
        errors.append(np.abs(predicted - truth) / truth)
    if not errors:
        raise InputError.at(None, "series", f"{truth_all.size} points leave no origin for warmup {warmup}")
    return float(np.mean(errors))
