"""jabas's ``similarity`` GBS policy, derived from a trace's gradient statistics.

jabas's ``similarity`` policy (SimiGrad; ``[batching] metric = "similarity"``)
measures ``c``, the cosine between the gradients of the two halves of the global
batch, and moves the GBS ``M`` by ``adjust_rate`` ``r`` every ``adjust_interval``
iterations: ``c < c*`` grows it to ``M (1 + r)``, ``c > c*`` shrinks it to
``M (1 - r)`` (``c*`` = ``similarity_target``).

The trace does not record ``c``, but its statistics give its expectation. Each
half averages ``M / 2`` samples, so ``E[g_A . g_B] = |G|^2`` and
``E|g_A|^2 = E|g_B|^2 = |G|^2 + tr(Sigma) / (M / 2)``; with ``tr(Sigma) =
M0 * grad_var``, ``|G|^2 = grad_sqr`` and ``B_noise = tr(Sigma) / |G|^2``:

    c(M) ~ |G|^2 / (|G|^2 + 2 tr(Sigma) / M) = 1 / (1 + 2 B_noise / M)

(a ratio of expectations: the gradients have millions of coordinates, so their
norms concentrate and the ratio's expectation is close to it). ``c`` rises with
``M``, so the rule drives ``M`` to the fixed point ``c(M*) = c*``:

    M* = 2 B_noise c* / (1 - c*)

at most a factor ``(1 + r)`` per adjustment. The simulator applies, at each
epoch start, the adjustments of the coming epoch at once:
``n = iterations / adjust_interval`` of them, moving ``M`` toward ``M*`` by at
most ``(1 + r)^n`` (or ``(1 - r)^n``), with ``B_noise`` as last measured.
"""

from __future__ import annotations

# jabas's defaults ([batching] in jabas.toml)
SIMILARITY_TARGET = 0.1
ADJUST_RATE = 0.1
ADJUST_INTERVAL = 100


def expected_similarity(gbs: float, noise_scale: float) -> float:
    """``E[cos(g_A, g_B)]`` at GBS ``gbs`` (formula above)."""
    return 1.0 / (1.0 + 2.0 * noise_scale / gbs)


def fixed_point(noise_scale: float, target: float = SIMILARITY_TARGET) -> float:
    """The GBS at which the expected similarity equals ``target``."""
    return 2.0 * noise_scale * target / (1.0 - target)


def next_gbs(
    gbs: float,
    noise_scale: float,
    iterations: float,
    *,
    low: float,
    high: float,
    target: float = SIMILARITY_TARGET,
    rate: float = ADJUST_RATE,
    interval: int = ADJUST_INTERVAL,
) -> float:
    """The GBS after ``iterations`` iterations of the rule, clamped to ``[low, high]``."""
    steps = max(1, int(iterations // interval))
    goal = fixed_point(noise_scale, target)
    moved = min(goal, gbs * (1 + rate) ** steps) if goal > gbs else max(goal, gbs * (1 - rate) ** steps)
    return min(max(moved, low), high)
