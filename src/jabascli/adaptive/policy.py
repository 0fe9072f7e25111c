"""GBS policies: from one measurement to the GBS the job should move towards.

Every policy proposes a target GBS ``M'`` from the current GBS ``M``, with
``r = adjust_rate`` and bounds ``[gbs_min, gbs_max]``:

* ``similarity`` (SimiGrad): ``c`` = cosine between the halves' gradients, ``c*`` =
  ``similarity_target``. ``c < c*``: the gradients disagree (noisy), grow:
  ``M' = M (1 + r)``; ``c > c*``: shrink, ``M' = M (1 - r)``; ``c = c*``: keep.
* ``noise_scale``: move towards the smoothed ``B_noise``, at most ``r``:
  ``M' = clip(B_noise, M (1 - r), M (1 + r))``.
* ``goodput`` (Pollux): among the reachable GBS within ``r`` of ``M``, the one
  maximising ``throughput(M') x efficiency(M')``, where ``throughput`` is the
  solver's predicted samples per second for the job's servers and
  ``efficiency(M') = (B_noise + M0) / (B_noise + M')``, ``M0`` the initial GBS.
* ``fixed``: ``M' = M``.

With one worker (``W = 1``) nothing can be measured (no second half): every
adaptive policy then proposes two workers, ``M' = 2 M`` (beyond ``r`` if need
be), so that the next adjustment can measure. The target is always clamped
to the bounds. :class:`Steadiness` then decides whether to act on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METRICS = ("similarity", "noise_scale", "goodput", "fixed")


@dataclass(frozen=True)
class Reading:
    """What one measurement iteration saw (None: not measurable, e.g. one worker)."""

    similarity: float | None
    noise_scale: float | None
    """Smoothed ``B_noise`` in samples."""


def clamp(gbs: float, low: int, high: int) -> float:
    return min(max(gbs, low), high)


def efficiency(gbs: float, noise_scale: float, initial_gbs: int) -> float:
    """Pollux's statistical efficiency of GBS ``gbs`` relative to ``initial_gbs``: ``(B + M0) / (B + M)``."""
    return (noise_scale + initial_gbs) / (noise_scale + gbs)


def propose(
    metric: str,
    gbs: int,
    reading: Reading,
    *,
    low: int,
    high: int,
    rate: float,
    similarity_target: float,
    initial_gbs: int,
    throughput: Mapping[int, float] | None = None,
) -> float:
    """The target GBS, clamped to ``[low, high]`` (see the module docstring)."""
    if metric == "fixed":
        return gbs
    if reading.similarity is None and reading.noise_scale is None:
        return clamp(2 * gbs, low, high)
    if metric == "similarity":
        assert reading.similarity is not None
        if reading.similarity < similarity_target:
            return clamp(gbs * (1 + rate), low, high)
        if reading.similarity > similarity_target:
            return clamp(gbs * (1 - rate), low, high)
        return clamp(gbs, low, high)
    noise = reading.noise_scale
    if noise is None:
        return clamp(gbs, low, high)
    if metric == "noise_scale":
        return clamp(min(max(noise, gbs * (1 - rate)), gbs * (1 + rate)), low, high)
    if metric == "goodput":
        return best_goodput(gbs, noise, throughput or {}, low=low, high=high, rate=rate, initial_gbs=initial_gbs)
    raise ValueError(f"unknown metric {metric!r}")


def best_goodput(
    gbs: int, noise: float, throughput: Mapping[int, float], *, low: int, high: int, rate: float, initial_gbs: int
) -> float:
    """The reachable GBS within ``rate`` of ``gbs`` and the bounds with the largest goodput (``gbs`` if none)."""
    lo, hi = max(low, gbs * (1 - rate)), min(high, gbs * (1 + rate))
    candidates = {m: t for m, t in throughput.items() if lo <= m <= hi and t > 0}
    if not candidates:
        return clamp(gbs, low, high)
    return max(sorted(candidates), key=lambda m: candidates[m] * efficiency(m, noise, initial_gbs))


@dataclass
class Steadiness:
    """The rule that keeps the GBS from flapping up and down at every adjustment.

    1. Dead band: a target within ``dead_band = min(5%, adjust_rate / 2)`` of
       the current GBS is ignored (AdaptDL found gains under ~5% not worth a change).
    2. Reversal: a change opposite to the previous change is made only when two
       consecutive adjustments ask for it; a single contrary reading is ignored.

    So a metric that hovers around its target, or one noisy reading, does not
    move the GBS back and forth; a sustained trend still does, one adjustment late.
    """

    dead_band: float = 0.05
    last_direction: int = 0
    """+1 after a growth, -1 after a shrink, 0 before any change."""
    pending: int = 0
    """The direction of a reversal asked once and not yet made (0: none)."""

    def direction(self, gbs: int, target: float) -> int:
        """+1 (grow), -1 (shrink) or 0 (keep) for this adjustment; records the state."""
        if abs(target - gbs) <= self.dead_band * gbs:
            self.pending = 0
            return 0
        wanted = 1 if target > gbs else -1
        if self.last_direction in (0, wanted):
            self.pending = 0
            return wanted
        if self.pending == wanted:
            self.pending = 0
            return wanted
        self.pending = wanted
        return 0

    def changed(self, direction: int) -> None:
        """A change in ``direction`` was made."""
        self.last_direction = direction

    def state_dict(self) -> dict[str, Any]:
        return {"dead_band": self.dead_band, "last_direction": self.last_direction, "pending": self.pending}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Steadiness:
        return cls(float(state["dead_band"]), int(state["last_direction"]), int(state["pending"]))
