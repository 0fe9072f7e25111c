"""Computation model of one device type at one local batch size.

Built from the computation profiles (milliseconds) and the memory profile of
one profiled server; every time here is in seconds.

* data, forward and backward time of one micro-step of ``v`` VSWs: a
  :class:`~jabascli.perfmodel.fit.VswCurve` through the measured VSW counts;
* update time: one optimizer step, independent of the batch and of the VSW
  count, so the mean over every measured point of the device;
* copy time: copying the updated weights to each extra VSW replica,
  ``copy_per_replica * (v - 1)``, the slope fitted by least squares through
  the origin over every measured point with ``v > 1`` (0 when there is none);
* BatchNorm sync: ``bn_sync * v``, once per iteration, as in the seed;
* overhead: the engine's own work once per iteration (zeroing gradients,
  BatchNorm statistics, LR scheduler, the loop), the mean ``overhead_time``
  over every measured point (0 for seed profiles, which do not measure it);
* overlap update: what ``overlap`` weight sync's per-bucket optimizer steps
  add to an iteration, the mean ``overlap_update_time`` over the points that
  measured it (None for seed profiles);
* spread: the standard deviation of one iteration's time at ``v`` VSWs,
  ``(p75 - p25) / 1.349`` of the measured iterations' totals (a normal
  distribution's interquartile range is 1.349 of its standard deviation),
  through the measured VSW counts (0 for seed profiles, which have no
  quartiles). The iteration model turns it into the synchronisation wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from jabascli.errors import InputError
from jabascli.perfmodel.fit import FloatArray, VswCurve
from jabascli.profiles import CompProfile, ProfileSet

MS = 1e-3
IQR_PER_SIGMA = 1.349  # interquartile range of a normal distribution, in standard deviations


@dataclass(frozen=True)
class DeviceModel:
    """Compute times (seconds) of one device type at one LBS, for any VSW count up to ``max_vsw``."""

    server: str
    """The profiled server whose measurements these are."""
    device_type: str
    lbs: int
    max_vsw: int
    data: VswCurve
    forward: VswCurve
    backward: VswCurve
    update_s: float
    copy_per_replica_s: float
    bn_sync_s: float
    overhead_s: float = 0.0
    """Once per iteration, whatever the VSW and GA counts (see :mod:`jabascli.engine.timing`)."""
    overlap_update_s: float | None = None
    """What ``overlap`` weight sync's per-bucket optimizer steps add to an iteration, as measured (None:
    not measured, as in seed profiles; the model then assumes all but the last bucket's share is hidden)."""
    spread: VswCurve | None = None
    """Standard deviation (seconds) of one iteration of ``v`` VSWs; None when the profiles have no quartiles."""

    def spread_s(self, vsw: ArrayLike) -> FloatArray:
        if self.spread is None:
            return np.zeros(np.shape(vsw))
        return self.spread(vsw)

    def phases(self, vsw: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Data, forward and backward time of one micro-step of ``vsw`` VSWs."""
        return self.data(vsw), self.forward(vsw), self.backward(vsw)

    def copy_s(self, vsw: ArrayLike) -> FloatArray:
        return self.copy_per_replica_s * (np.asarray(vsw, dtype=np.float64) - 1.0)


def device_constants(points: list[CompProfile]) -> tuple[float, float, float]:
    """``(update_s, copy_per_replica_s, bn_sync_s)`` from every measured point of a device."""
    update = float(np.mean([p.update_time for p in points])) * MS
    bn_sync = float(np.mean([p.bn_sync_time for p in points])) * MS
    extra = np.array([p.num_models - 1 for p in points if p.num_models > 1], dtype=np.float64)
    copies = np.array([p.copy_time for p in points if p.num_models > 1], dtype=np.float64)
    copy = float(extra @ copies / (extra @ extra)) * MS if extra.size else 0.0
    return update, copy, bn_sync


def build_device_model(
    profiles: ProfileSet, server: str, lbs: int, folders: dict[str, Path] | None = None
) -> DeviceModel:
    """The compute model of profiled ``server`` at ``lbs``; InputError when it was not profiled there."""
    folders = {**profiles.folders, **(folders or {})}
    max_vsw = profiles.max_vsw(server, lbs)
    points = profiles.comp_points(server, lbs)
    where = folders.get("computation", "computation profiles")
    if max_vsw < 1:
        memory = folders.get("memory", "memory profiles")
        reason = "no memory profile" if (server, lbs) not in profiles.memory else "not even one VSW fits in memory"
        raise InputError.at(memory, f"{lbs}/{server}", f"LBS {lbs} cannot run on {server}: {reason}")
    if not points:
        raise InputError.at(where, f"{lbs}/{server}", f"no computation profile of {server} at LBS {lbs}")
    every_point = [p for (s, _, _), p in profiles.comp.items() if s == server]
    update, copy, bn_sync = device_constants(every_point)
    overhead = float(np.mean([p.overhead_time for p in every_point])) * MS
    measured = [p.overlap_update_time for p in every_point if p.overlap_update_time is not None]
    overlap_update = float(np.mean(measured)) * MS if measured else None
    first = next(iter(points.values()))

    def curve(field: str) -> VswCurve:
        return VswCurve.through((n, getattr(p, field) * MS) for n, p in points.items())

    quartiles = {n: (p.spread or {}).get("total_time") for n, p in points.items()}
    spread = None
    if all(q is not None and len(q) == 2 for q in quartiles.values()):
        spread = VswCurve.through((n, max(q[1] - q[0], 0.0) / IQR_PER_SIGMA * MS) for n, q in quartiles.items())  # type: ignore[index]

    return DeviceModel(
        server=server,
        device_type=first.gpu_type,
        lbs=lbs,
        max_vsw=max_vsw,
        data=curve("data_time"),
        forward=curve("fwd_time"),
        backward=curve("bwd_time"),
        update_s=update,
        copy_per_replica_s=copy,
        bn_sync_s=bn_sync,
        overhead_s=overhead,
        overlap_update_s=overlap_update,
        spread=spread,
    )
