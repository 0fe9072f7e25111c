"""A GBS trajectory: how many iterations run at each GBS.

The adaptive batching policy holds the GBS for ``adjust_interval`` iterations
between adjustments. An epoch of ``dataset_size`` samples at GBS values
``g[0], g[1], ...`` (one per adjustment point) is the segments

    (g[k], min(adjust_interval, iterations left at g[k]))

until the samples add up to the dataset; the last iteration may be partial and
counts whole (``ceil``), as a data loader's last batch does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jabascli.errors import InputError


@dataclass(frozen=True)
class Segment:
    """``iterations`` iterations at global batch size ``gbs``."""

    gbs: int
    iterations: int

    @property
    def samples(self) -> int:
        return self.gbs * self.iterations


def epoch_segments(values: Sequence[int], dataset_size: int, adjust_interval: int) -> list[Segment]:
    """One epoch of ``dataset_size`` samples along ``values`` (the last value holds if they run out)."""
    if dataset_size < 1 or adjust_interval < 1:
        raise InputError.at(None, "trajectory", "dataset size and adjust interval must be positive")
    if not values:
        raise InputError.at(None, "trajectory", "no GBS values")
    left, segments, k = dataset_size, [], 0
    while left > 0:
        gbs = int(values[min(k, len(values) - 1)])
        iterations = min(adjust_interval, math.ceil(left / gbs))
        segments.append(Segment(gbs, iterations))
        left -= gbs * iterations
        k += 1
    return segments


def points_per_epoch(values: Sequence[int], dataset_size: int, adjust_interval: int) -> int:
    """How many adjustment points of ``values`` one epoch uses."""
    return len(epoch_segments(values, dataset_size, adjust_interval))


def merge(segments: Iterable[Segment]) -> list[Segment]:
    """Iterations summed per GBS, in order of first appearance (what a cost only needs)."""
    totals: dict[int, int] = {}
    for s in segments:
        totals[s.gbs] = totals.get(s.gbs, 0) + s.iterations
    return [Segment(g, n) for g, n in totals.items()]
