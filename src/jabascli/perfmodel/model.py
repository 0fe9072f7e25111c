"""The performance model of one job: compute models per device type and LBS, all-reduce, iteration time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from numpy.typing import ArrayLike

from jabascli.perfmodel.comm import BucketTimes, CommModel
from jabascli.perfmodel.compute import DeviceModel, build_device_model, interpolate_device_model
from jabascli.perfmodel.fit import FloatArray
from jabascli.perfmodel.iteration import (
    Allocation,
    Breakdown,
    ServerSpec,
    WeightSyncMethod,
    breakdown,
    iteration_times,
)
from jabascli.profiles import ProfileSet


@dataclass(frozen=True)
class GroupConfig:
    """``gpus`` GPUs of one server, each running ``vsw`` VSWs with ``ga`` extra GA micro-steps."""

    server: ServerSpec
    gpus: int
    vsw: int
    ga: int
    lbs: int | None = None
    """The group's own LBS (an uneven plan's); None: the prediction's."""

    @property
    def workers(self) -> int:
        """IIDP workers of the group: ``gpus * vsw * (ga + 1)``."""
        return self.gpus * self.vsw * (self.ga + 1)


@dataclass(frozen=True)
class GroupPrediction:
    group: GroupConfig
    breakdown: Breakdown

    @property
    def time_s(self) -> float:
        return self.breakdown.total_s


@dataclass(frozen=True)
class IterationPrediction:
    """Predicted iteration of a whole allocation: the slowest GPU sets the pace."""

    lbs: int
    weight_sync: WeightSyncMethod
    allocation: Allocation
    buckets: BucketTimes
    groups: tuple[GroupPrediction, ...]

    @property
    def gbs(self) -> int:
        """Samples per iteration: every group's workers times its own LBS (else the prediction's)."""
        return sum(g.group.workers * (g.group.lbs or self.lbs) for g in self.groups)

    @property
    def time_s(self) -> float:
        return max(g.time_s for g in self.groups)

    @property
    def throughput(self) -> float:
        """Samples per second: ``GBS / iteration time``."""
        return self.gbs / self.time_s


class PerformanceModel:
    """Predicts iteration times from a job's profiles; pure Python + numpy.

    ``folders`` (profile kind -> folder) only makes error messages point at the
    right place; ``ProfileSet.folders`` is used when it is not given.
    """

    def __init__(self, profiles: ProfileSet, folders: dict[str, Path] | None = None) -> None:
        self.profiles = profiles
        self.folders = {**profiles.folders, **(folders or {})}
        self.comm = CommModel.from_profiles(profiles, self.folders)
        self._devices: dict[tuple[str, int], DeviceModel] = {}
        self._lbs: dict[str, list[int]] = {}

    def lbs_values(self, profile_server: str) -> list[int]:
        """LBS values at which ``profile_server`` fits a VSW and has a computation profile."""
        if profile_server not in self._lbs:
            measured = {b for s, b, _ in self.profiles.comp if s == profile_server}
            self._lbs[profile_server] = [b for b in self.profiles.lbs_values(profile_server) if b in measured]
        return list(self._lbs[profile_server])

    def points(self, profile_server: str, lbs: int) -> list[int]:
        """The LBS whose computation profiles the model at ``lbs`` is built from: ``lbs`` itself, or the two profiled
        LBS around it that :meth:`device` interpolates between."""
        values = self.lbs_values(profile_server)
        low = [b for b in values if b < lbs]
        high = [b for b in values if b > lbs]
        fits = (profile_server, lbs) not in self.profiles.memory or self.profiles.max_vsw(profile_server, lbs) > 0
        return [low[-1], high[0]] if lbs not in values and fits and low and high else [lbs]

    def device(self, profile_server: str, lbs: int) -> DeviceModel:
        """The compute model at ``lbs``: profiled, or interpolated between the two profiled LBS around it
        (:func:`~jabascli.perfmodel.compute.interpolate_device_model`); InputError outside the profiled
        range (no extrapolation: a larger batch may not fit, and a smaller one's fixed costs are unknown)."""
        key = (profile_server, lbs)
        if key not in self._devices:
            points = self.points(profile_server, lbs)
            if len(points) == 2:
                below, above = (self.device(profile_server, b) for b in points)
                self._devices[key] = interpolate_device_model(below, above, lbs)
            else:
                self._devices[key] = build_device_model(self.profiles, profile_server, lbs, self.folders)
        return self._devices[key]

    def lbs_range(self, profile_server: str) -> tuple[int, int] | None:
        """The smallest and largest LBS :meth:`device` models on ``profile_server`` (None: none)."""
        values = self.lbs_values(profile_server)
        return (values[0], values[-1]) if values else None

    def bucket_times(self, allocation: Allocation) -> BucketTimes:
        return self.comm.buckets(allocation.world_size, allocation.servers, allocation.bandwidth)

    def iteration_times(
        self,
        device: DeviceModel,
        vsw: ArrayLike,
        ga: ArrayLike,
        weight_sync: WeightSyncMethod,
        buckets: BucketTimes,
    ) -> FloatArray:
        """Vectorised ``T(v, g)`` of one GPU (what the solver tabulates)."""
        return iteration_times(device, vsw, ga, weight_sync, buckets)

    def predict(self, lbs: int, weight_sync: WeightSyncMethod, groups: Sequence[GroupConfig]) -> IterationPrediction:
        """Predicted iteration time of the allocation the groups make up, with each group's breakdown.

        A group with its own ``lbs`` (an uneven plan) is predicted at that LBS, interpolated between
        profiled ones where it was not profiled (:meth:`device`)."""
        if not groups:
            raise ValueError("nothing to predict: no GPU groups")
        for g in groups:
            if g.gpus < 1 or g.vsw < 1 or g.ga < 0:
                raise ValueError(f"{g.server.name}: need gpus >= 1, vsw >= 1 and ga >= 0, got {g}")
        allocation = Allocation.of((g.server, g.gpus) for g in groups)
        buckets = self.bucket_times(allocation)
        predictions = tuple(
            GroupPrediction(
                g, breakdown(self.device(g.server.profile_server, g.lbs or lbs), g.vsw, g.ga, weight_sync, buckets)
            )
            for g in groups
        )
        return IterationPrediction(lbs, weight_sync, allocation, buckets, predictions)
