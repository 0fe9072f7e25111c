"""The two curve fits the performance model uses (numpy only).

* :class:`VswCurve`: a time as a function of the VSW count, piecewise linear
  through the measured points. Measured points are reproduced exactly; between
  two of them the time is interpolated linearly; below the first one it follows
  the line through the origin; above the last one the last measured marginal
  cost per VSW continues (or, when noise makes that slope non-positive, the
  mean cost per VSW of the last point). One measured point gives the line
  through the origin, i.e. no gain from concurrency is assumed.
* :class:`LinearFit`: an ordinary least-squares line, used for the all-reduce
  time against its bandwidth-only ideal.

``docs/performance-model.md`` explains why these fits were chosen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]


@dataclass(frozen=True)
class VswCurve:
    """Time against VSW count, through measured ``(vsw, time)`` points."""

    vsws: tuple[float, ...]
    times: tuple[float, ...]

    @classmethod
    def through(cls, points: Iterable[tuple[float, float]]) -> VswCurve:
        pairs = sorted(points)
        if not pairs:
            raise ValueError("a VSW curve needs at least one measured point")
        vsws = [float(v) for v, _ in pairs]
        if vsws[0] <= 0 or len(set(vsws)) != len(vsws):
            raise ValueError(f"VSW counts must be positive and distinct, got {vsws}")
        return cls(tuple(vsws), tuple(float(t) for _, t in pairs))

    @property
    def tail_slope(self) -> float:
        """Time per VSW beyond the last measured count."""
        v, t = self.vsws, self.times
        if len(v) >= 2:
            slope = (t[-1] - t[-2]) / (v[-1] - v[-2])
            if slope > 0:
                return slope
        return t[-1] / v[-1]

    def __call__(self, vsw: ArrayLike) -> FloatArray:
        x = np.asarray(vsw, dtype=np.float64)
        v, t = self.vsws, self.times
        inside = np.interp(x, v, t)
        below = x * (t[0] / v[0])
        above = t[-1] + (x - v[-1]) * self.tail_slope
        return np.where(x < v[0], below, np.where(x > v[-1], above, inside))


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x``, fitted by least squares."""

    intercept: float
    slope: float

    @classmethod
    def least_squares(cls, x: ArrayLike, y: ArrayLike) -> LinearFit:
        xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if xs.size == 0 or xs.shape != ys.shape:
            raise ValueError("a linear fit needs paired, non-empty data")
        if xs.size == 1 or np.ptp(xs) == 0:
            # One abscissa: the line through the origin and the mean point.
            mean_x = float(xs.mean())
            return cls(0.0, float(ys.mean()) / mean_x if mean_x > 0 else 0.0)
        slope, intercept = np.polyfit(xs, ys, 1)
        return cls(float(intercept), float(slope))

    def __call__(self, x: ArrayLike) -> FloatArray:
        return self.intercept + self.slope * np.asarray(x, dtype=np.float64)
