"""Which LBS values ``jabas profile all`` measures: those that balanced splits need over the GBS range.

IIDP balances heterogeneous devices by giving each the same LBS and a worker
count in proportion to its speed. For a GBS ``g`` and per-device speeds
``s_i`` (relative; one entry per device of every server), the split is finest
where the slowest device holds exactly one worker:

    LBS_bal(g) = g * s_min / sum_i s_i

A larger LBS leaves the slow device either idle-heavy (one worker, too much
for it) or out; a smaller one only splits finer. The profile plan is every
power of two from ``LBS_bal(gbs_min)`` rounded down to a power of two (at
least ``MIN_LBS``) up to ``gbs_max``; the memory sweep stops earlier where not
even one VSW fits. Powers of two: each halving of the LBS doubles the workers,
so a split within a factor of two of the balance is always a candidate, and
the sweep is ``log2(gbs_max / LBS_bal)`` points instead of ``gbs_max / step``.

Speeds: an emulated server runs ``emulate.slowdown`` times slower than a plain
CPU server; servers that all state ``tflops`` use them; otherwise devices of
another type than the first server's are assumed up to ``UNKNOWN_RATIO`` times
slower (a guess that only makes the plan start at a smaller LBS).
"""

from __future__ import annotations

from collections.abc import Sequence

from jabascli.config.models import ServerConfig

MIN_LBS = 1
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


def lbs_plan(gbs_min: int, gbs_max: int, speeds: Sequence[float]) -> list[int]:
    """Powers of two from the balanced LBS of ``gbs_min`` up to ``gbs_max`` (the memory sweep may stop sooner)."""
    lbs, out = balanced_lbs(min(gbs_min, gbs_max), speeds), []
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
