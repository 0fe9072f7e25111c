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
* VSWs only where they pay: ``max_vsw`` is the memory profile's limit when a
  measured VSW count ``v > 1`` does one micro-step in at most
  ``(1 - VSW_GAIN)`` of ``v`` times one VSW's (data, forward, backward and the
  weight copy, per VSW, against the same for one VSW: what GA would do with
  the same workers), and 1 otherwise: where streams do not overlap (the CPU,
  where VSWs run in turn, or a saturated GPU) GA trains the same workers with
  less memory, and a gain within the noise of the profiles must not decide.
  Decided at this LBS when a count above 1 was measured here, else at the
  nearest measured LBS below (then above) that has one; a device where no
  count above 1 was measured at any LBS gets 1.

Between two profiled LBS values (an uneven plan's own LBS, :mod:`jabascli.solver.uneven`),
:func:`interpolate_device_model` interpolates the neighbours' models linearly in
the batch size: for ``lo < b < hi`` the profiled neighbours and every phase
(data, forward, backward, spread) at ``v`` VSWs,

    t(b, v) = t(lo, v) + (b - lo) / (hi - lo) * (t(hi, v) - t(lo, v))

A micro-step's compute is close to affine in its batch size between two
neighbouring profiled sizes (a fixed kernel-launch and framework cost plus a
per-sample cost), so the chord is what the profiles support. The per-device
constants (update, copy, BatchNorm sync, overhead) do not depend on the LBS.
The VSW limits are the smaller of the two neighbours' (a batch between the two
needs no more memory than ``hi``'s; the smaller limit keeps what ``lo`` found too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from jabascli.errors import InputError
from jabascli.perfmodel.fit import FloatArray, VswCurve
from jabascli.profiles import CompProfile, ProfileSet

MS = 1e-3
IQR_PER_SIGMA = 1.349  # interquartile range of a normal distribution, in standard deviations
VSW_GAIN = 0.05
"""VSWs pay when a micro-step per VSW is at least this much faster than one VSW's."""


@dataclass(frozen=True)
class DeviceModel:
    """Compute times (seconds) of one device type at one LBS, for any VSW count up to ``max_vsw``."""

    server: str
    """The profiled server whose measurements these are."""
    device_type: str
    lbs: int
    max_vsw: int
    """The most VSWs the solver gives a device: the memory profile's limit where VSWs pay, else 1."""
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
    fits_vsw: int | None = None
    """The memory profile's limit (None: ``max_vsw``)."""

    def spread_s(self, vsw: ArrayLike) -> FloatArray:
        if self.spread is None:
            return np.zeros(np.shape(vsw))
        return self.spread(vsw)

    def phases(self, vsw: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Data, forward and backward time of one micro-step of ``vsw`` VSWs."""
        return self.data(vsw), self.forward(vsw), self.backward(vsw)

    def copy_s(self, vsw: ArrayLike) -> FloatArray:
        return self.copy_per_replica_s * (np.asarray(vsw, dtype=np.float64) - 1.0)


def interpolate_device_model(low: DeviceModel, high: DeviceModel, lbs: int) -> DeviceModel:
    """The model at ``lbs``, strictly between ``low.lbs`` and ``high.lbs``: the chord of the two (module doc)."""
    if not low.lbs < lbs < high.lbs or low.server != high.server:
        raise ValueError(f"LBS {lbs} is not between {low.server}'s LBS {low.lbs} and {high.server}'s LBS {high.lbs}")
    w = (lbs - low.lbs) / (high.lbs - low.lbs)

    def chord(a: VswCurve, b: VswCurve) -> VswCurve:
        counts = sorted(set(a.vsws) | set(b.vsws))
        return VswCurve.through((v, float(a(v)) + w * (float(b(v)) - float(a(v)))) for v in counts)

    spread = chord(low.spread, high.spread) if low.spread is not None and high.spread is not None else None
    return replace(
        low,
        lbs=lbs,
        max_vsw=min(low.max_vsw, high.max_vsw),
        data=chord(low.data, high.data),
        forward=chord(low.forward, high.forward),
        backward=chord(low.backward, high.backward),
        spread=spread,
        fits_vsw=min(low.fits_vsw or low.max_vsw, high.fits_vsw or high.max_vsw),
    )


def vsw_pays(points: Iterable[CompProfile]) -> bool:
    """Whether some measured VSW count above 1 at one LBS beats one VSW by ``VSW_GAIN`` per micro-step.

    True when there is no one-VSW point to compare with (nothing says they do not pay).
    """
    by_count = {p.num_models: p for p in points}
    one = by_count.get(1)
    if one is None:
        return True
    single = one.data_time + one.fwd_time + one.bwd_time
    return any(
        (p.data_time + p.fwd_time + p.bwd_time + p.copy_time) / v <= (1 - VSW_GAIN) * single
        for v, p in by_count.items()
        if v > 1
    )


def _vsw_pay_at(every_point: list[CompProfile], lbs: int) -> bool:
    """:func:`vsw_pays` at ``lbs``, else at the nearest LBS below (then above) where a sweep was measured."""
    swept = sorted({p.lbs for p in every_point if p.num_models > 1})
    if not swept:
        return False
    below = [b for b in swept if b <= lbs]
    at = below[-1] if below else swept[0]
    return vsw_pays(p for p in every_point if p.lbs == at)


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
    usable = max_vsw if _vsw_pay_at(every_point, lbs) else 1

    return DeviceModel(
        server=server,
        device_type=first.gpu_type,
        lbs=lbs,
        max_vsw=usable,
        data=curve("data_time"),
        forward=curve("fwd_time"),
        backward=curve("bwd_time"),
        update_s=update,
        copy_per_replica_s=copy,
        bn_sync_s=bn_sync,
        overhead_s=overhead,
        overlap_update_s=overlap_update,
        spread=spread,
        fits_vsw=max_vsw,
    )
