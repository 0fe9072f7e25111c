"""Gradient statistics from the two halves of one iteration's workers.

The job's ``W = GBS / LBS`` workers are split by worker index (see
:meth:`jabascli.engine.plan.TrainingPlan.worker_offset`): half ``A`` is workers
``0 .. W_A - 1`` with ``W_A = floor(W / 2)``, half ``B`` the other ``W_B = W - W_A``.
Every worker's gradient ``g_w`` is the mean over its LBS samples, and the engine
accumulates ``sum_w g_w / W``, so with ``F = sum_{w in A} g_w / W`` (the
all-reduced first-half buffer) and ``T = sum_w g_w / W`` (the full gradient)::

    g_A = F * W / W_A        g_B = (T - F) * W / W_B        g = T

**Similarity** (SimiGrad): ``cos(g_A, g_B) = F.(T - F) / (|F| |T - F|)``.

**Noise scale** (McCandlish et al. 2018, appendix A.1). With ``B_A = W_A LBS``,
``B_B = W_B LBS`` and ``B = GBS`` samples, ``E|g_X|^2 = |G|^2 + tr(Sigma) / B_X``, so

    S = (B_A |g_A|^2 + B_B |g_B|^2) / B        has  E[S] = |G|^2 + tr(Sigma) / (B / 2)

whatever the split, and the small/big-batch estimators with ``B_small = B / 2``
and ``B_big = B`` are

    |G|^2      ~ (B |g|^2 - (B/2) S) / (B/2)        = 2 |g|^2 - S
    tr(Sigma)  ~ (S - |g|^2) / (1/(B/2) - 1/B)      = B (S - |g|^2)

each unbiased on its own (their ratio is not: see :mod:`jabascli.adaptive.noise`,
which smooths them separately). With one worker there is no second half:
:func:`half_split` returns 0 and nothing is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def half_split(workers: int) -> int:
    """``W_A``: workers ``0 .. W_A - 1`` form the first half; 0 when there is nothing to split."""
    return workers // 2


@dataclass(frozen=True)
class HalfGradients:
    """The three inner products one measurement needs, all-reduced (identical on every rank)."""

    ff: float
    """``|F|^2``."""
    ft: float
    """``F . T``."""
    tt: float
    """``|T|^2``."""
    workers: int
    """``W``."""
    lbs: int

    @property
    def first(self) -> int:
        return half_split(self.workers)

    @property
    def second(self) -> int:
        return self.workers - self.first

    def unscaled(self, scale: float) -> HalfGradients:
        """The products of gradients that were ``scale`` times the true ones (fp16's loss scale ``S``): ``/ S^2``."""
        s2 = scale * scale
        return HalfGradients(self.ff / s2, self.ft / s2, self.tt / s2, self.workers, self.lbs)

    def finite(self) -> bool:
        """False when a gradient held an inf or NaN (an fp16 step the loss scaler skips)."""
        return all(math.isfinite(x) for x in (self.ff, self.ft, self.tt))

    def half_norms(self) -> tuple[float, float, float]:
        """``(|g_A|^2, |g_B|^2, g_A . g_B)``."""
        w, a, b = self.workers, self.first, self.second
        rest_sq = self.tt - 2 * self.ft + self.ff  # |T - F|^2
        cross = self.ft - self.ff  # F . (T - F)
        return self.ff * (w / a) ** 2, rest_sq * (w / b) ** 2, cross * (w / a) * (w / b)

    def similarity(self) -> float:
        """Cosine between the halves' mean gradients (0 when one of them is zero)."""
        aa, bb, ab = self.half_norms()
        denominator = math.sqrt(max(aa, 0.0) * max(bb, 0.0))
        return ab / denominator if denominator > 0 else 0.0

    def noise(self) -> tuple[float, float]:
        """Unbiased ``(|G|^2, tr(Sigma))`` estimates (see the module docstring)."""
        aa, bb, _ = self.half_norms()
        big = self.workers * self.lbs
        small_sq = (self.first * aa + self.second * bb) / self.workers  # S: B_X / B = W_X / W
        return 2 * self.tt - small_sq, big * (small_sq - self.tt)
