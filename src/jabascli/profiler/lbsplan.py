"""Which LBS values ``jabas profile all`` measures: those that balanced splits need over the GBS range.

IIDP balances heterogeneous devices by giving each the same LBS and a worker
count in proportion to its speed. For a GBS ``g`` and per-device speeds
``s_i`` (relative; one entry per device of every server), the split is finest
where the slowest device holds exactly one worker:

    LBS_bal(g) = g * s_min / sum_i s_i

A larger LBS leaves the slow device either idle-heavy (one worker, too much
for it) or out. Whole workers round the split: with speeds 1 and 1/1.5, GBS 64
at LBS 16 is 4 workers, and the best split (3 + 1 or 2 + 2) takes 3 units of
time where the balance takes 2.4 (:func:`split_efficiency` 0.8); at LBS 8, 5 +
3 workers take 5 units for 4.8 (0.96). So the smallest LBS of the plan is the
largest power of two at or below ``LBS_bal(gbs_min)`` whose best split of
``gbs_min`` is within ``BALANCE`` of the perfect one (at least ``MIN_LBS``),
and the plan is every power of two from it (or from ``MAX_FIRST_LBS``, if
smaller) up to ``gbs_max``; the memory sweep
stops earlier where not even one VSW fits. Powers of two: each halving of the
LBS doubles the workers, so a split within a factor of two of the balance is
always a candidate, in ``log2(gbs_max / LBS_min)`` points instead of
``gbs_max / step``.

Speeds: an emulated server runs ``emulate.slowdown`` times slower than a plain
CPU server; servers that all state ``tflops`` use them; otherwise devices of
another type than the first server's are assumed up to ``UNKNOWN_RATIO`` times
slower (a guess that only makes the plan start at a smaller LBS).
"""

from __future__ import annotations

from collections.abc import Sequence

from jabascli.config.models import ServerConfig

MIN_LBS = 1
MAX_FIRST_LBS = 32
"""The plan never starts above LBS 32 (the single profilers' default first LBS): GBS values in steps
of 32 stay reachable, whatever the cluster (one server alone would otherwise start at ``gbs_min``)."""
BALANCE = 0.9
"""The smallest LBS planned splits the smallest GBS within 10% of the perfect balance."""
UNKNOWN_RATIO = 4.0
"""Assumed speed ratio between device types whose speeds the config does not state."""


def floor_pow2(x: float) -> int:
    """The largest power of two at or below ``x`` (1 below 1)."""
    x *= 1 + 1e-9  # 224 * (1/3) / (7/3) is 31.99...: rounding must not halve the LBS
    if x < 2:
        return 1
    return 1 << (int(x).bit_length() - 1)


def balanced_lbs(gbs: int, speeds: Sequence[float]) -> int:
    """``LBS_bal(gbs)`` rounded down to a power of two: the slowest device holds one worker or more."""
    if not speeds:
        raise ValueError("no devices")
    return max(MIN_LBS, floor_pow2(gbs * min(speeds) / sum(speeds)))


def split_efficiency(workers: int, speeds: Sequence[float]) -> float:
    """The perfect balance's time over the best split's of ``workers`` whole workers, one device each at least.

    Workers go one at a time to the device that would finish them soonest, which minimises
    ``max_i w_i / s_i``; the perfect balance takes ``workers / sum s_i``.
    """
    if workers < len(speeds):
        return 0.0
    counts = [1] * len(speeds)
    for _ in range(workers - len(speeds)):
        best = min(range(len(speeds)), key=lambda i: (counts[i] + 1) / speeds[i])
        counts[best] += 1
    return workers / sum(speeds) / max(c / s for c, s in zip(counts, speeds, strict=True))


def smallest_lbs(gbs: int, speeds: Sequence[float]) -> int:
    """The largest power of two at or below ``LBS_bal(gbs)`` that splits ``gbs`` within ``BALANCE``."""
    lbs = balanced_lbs(gbs, speeds)
    while lbs > MIN_LBS and (gbs % lbs or split_efficiency(gbs // lbs, speeds) < BALANCE):
        lbs //= 2
    return lbs


def lbs_plan(gbs_min: int, gbs_max: int, speeds: Sequence[float]) -> list[int]:
    """Powers of two from :func:`smallest_lbs` of ``gbs_min`` up to ``gbs_max`` (memory may stop the sweep sooner)."""
    lbs, out = min(smallest_lbs(min(gbs_min, gbs_max), speeds), MAX_FIRST_LBS), []
    while lbs <= gbs_max:
        out.append(lbs)
        lbs *= 2
    return out


def device_speeds(servers: Sequence[ServerConfig]) -> list[float]:
    """Relative speed of every device of ``servers`` (the fastest kind 1), one entry per device."""
    if servers and all(s.tflops > 0 and s.emulate is None for s in servers):
        top = max(s.tflops for s in servers)
        return [s.tflops / top for s in servers for _ in range(s.devices)]
    first = next((s.device_type for s in servers if s.emulate is None), None)
    speeds = []
    for s in servers:
        if s.emulate is not None:
            speed = 1.0 / s.emulate.slowdown
        elif s.device_type == first or s.device_type == "cpu":
            speed = 1.0
        else:
            speed = 1.0 / UNKNOWN_RATIO
        speeds += [speed] * s.devices
    return speeds
