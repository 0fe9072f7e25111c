"""Iteration time of one GPU type from its traced rows, as the Pollux/Sia simulators read them.

``StepTimes.at(placement, lbs)`` returns ``(step_s, sync_s)``: the time of one
data-parallel iteration at local batch size ``lbs`` on ``placement`` (GPUs per
node), and the gradient-synchronisation part of it.

- A placement traced in ``placements-<type>.csv`` (compared up to rotation, as
  Pollux does): linear interpolation over LBS between that placement's rows, so a
  traced point is reproduced exactly and a monotone row set stays monotone.
- Any other placement: piecewise-linear interpolation over ``(num_nodes,
  num_replicas, local_bsz)`` on the Delaunay triangulation of every traced point
  (placements averaged per point, plus ``scalability-<type>.csv``), which is what
  Pollux's ``LinearNDInterpolator`` does. Outside the traced hull there is no
  answer (``None``): the configuration is not offered, as Sia marks it invalid.

Extra micro-steps (gradient accumulation, GA, and virtual stream workers, VSW)
cost ``step_s - sync_s`` each, the compute part of one iteration at that LBS
(Pollux's accumulation rule); :func:`micro_steps_time` applies it.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from scipy.interpolate import LinearNDInterpolator

from jabascli.simulate.trace import GPUS_PER_NODE, TimingRows

Placement = tuple[int, ...]


def packed_placement(gpus: int, per_node: int) -> Placement:
    """``gpus`` GPUs on as few nodes as possible: full nodes, then the rest on one node."""
    full, rest = divmod(gpus, per_node)
    return (per_node,) * full + ((rest,) if rest else ())


def placement_id(placement: Placement) -> str:
    """Pollux's key of a placement: the lexicographically smallest rotation, as digits."""
    parts = tuple(p for p in placement if p)
    smallest = min(parts[i:] + parts[:i] for i in range(len(parts)))
    return "".join(str(p) for p in smallest)


def micro_steps_time(step_s: float, sync_s: float, micro_steps: int) -> float:
    """One iteration with ``micro_steps`` forward/backward passes per GPU and one sync."""
    return step_s + (micro_steps - 1) * (step_s - sync_s)


class StepTimes:
    """Traced iteration times of one GPU type."""

    def __init__(self, rows: TimingRows) -> None:
        self.gpu_type = rows.gpu_type
        self.gpus_per_node = GPUS_PER_NODE[rows.gpu_type]
        grouped: dict[str, dict[float, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        for pid, lbs, step, sync in zip(
            rows.placement, rows.placement_lbs, rows.placement_step, rows.placement_sync, strict=True
        ):
            grouped[placement_id(tuple(int(c) for c in pid))][float(lbs)].append((float(step), float(sync)))
        self._curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        points: dict[tuple[float, float, float], list[tuple[float, float]]] = defaultdict(list)
        for pid, by_lbs in grouped.items():
            lbs = np.array(sorted(by_lbs))
            mean = np.array([np.mean(by_lbs[b], axis=0) for b in lbs])
            self._curves[pid] = (lbs, mean[:, 0], mean[:, 1])
            for b, (step, sync) in zip(lbs, mean, strict=True):
                points[(float(len(pid)), float(sum(int(c) for c in pid)), float(b))].append((step, sync))
        for n, r, b, step, sync in zip(
            rows.scal_nodes, rows.scal_replicas, rows.scal_lbs, rows.scal_step, rows.scal_sync, strict=True
        ):
            points[(float(n), float(r), float(b))].append((float(step), float(sync)))
        keys = sorted(points)
        self._points = np.array(keys)
        self._values = np.array([np.mean(points[k], axis=0) for k in keys])
        self._scal = np.column_stack([rows.scal_nodes, rows.scal_replicas, rows.scal_lbs])
        self._nd: LinearNDInterpolator | None = None
        self._cache: dict[tuple[str, float], tuple[float, float] | None] = {}
        self.min_lbs = float(self._points[:, 2].min())
        self.traced_lbs = np.unique(self._points[:, 2])

    def is_traced(self, placement: Placement) -> bool:
        return placement_id(placement) in self._curves

    def lbs_range(self, placement: Placement) -> tuple[float, float]:
        """The LBS range measured for ``placement`` (its memory limit is the top).

        For an untraced placement, Sia's rule: the largest LBS measured on at least
        as many nodes and replicas.
        """
        pid = placement_id(placement)
        if pid in self._curves:
            lbs = self._curves[pid][0]
            return float(lbs[0]), float(lbs[-1])
        nodes, replicas = len(pid), sum(int(c) for c in pid)
        mask = (self._scal[:, 0] >= nodes) & (self._scal[:, 1] >= replicas)
        top = float(self._scal[mask, 2].max()) if mask.any() else float(self._scal[:, 2].max())
        return self.min_lbs, top

    def at(self, placement: Placement, lbs: float) -> tuple[float, float] | None:
        """``(step_s, sync_s)`` of one iteration, or ``None`` outside the traced range."""
        pid = placement_id(placement)
        key = (pid, float(lbs))
        if key not in self._cache:
            self._cache[key] = self._lookup(pid, float(lbs))
        return self._cache[key]

    def _lookup(self, pid: str, lbs: float) -> tuple[float, float] | None:
        if pid in self._curves:
            xs, step, sync = self._curves[pid]
            if not xs[0] <= lbs <= xs[-1]:
                return None
            return float(np.interp(lbs, xs, step)), float(np.interp(lbs, xs, sync))
        query = np.array([len(pid), sum(int(c) for c in pid), lbs], dtype=float)
        # A coordinate every traced point shares (one node only, say) is dropped: the
        # triangulation needs full dimension, and a query off that value is outside.
        varying = self._points.max(axis=0) > self._points.min(axis=0)
        if np.any(query[~varying] != self._points[0, ~varying]):
            return None
        if varying.sum() == 1:
            xs = self._points[:, varying][:, 0]
            x = float(query[varying][0])
            if not xs.min() <= x <= xs.max():
                return None
            order = np.argsort(xs)
            return float(np.interp(x, xs[order], self._values[order, 0])), float(
                np.interp(x, xs[order], self._values[order, 1])
            )
        if self._nd is None:
            self._nd = LinearNDInterpolator(self._points[:, varying], self._values)
        value = self._nd([query[varying]])[0]
        if not np.all(np.isfinite(value)):
            return None
        return float(value[0]), float(value[1])
