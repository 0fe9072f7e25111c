"""All-reduce model: the time of each DDP gradient bucket's all-reduce in an allocation.

A communication profile pairs, per message size, the bandwidth-only ideal
time ``ideal_ms`` with the measured one. A least-squares line
``measured = intercept + slope * ideal`` turns the ideal time of any message
into a prediction (latency in the intercept, achieved bandwidth in the slope).
The ``intra`` profile is used when the allocation is one server, ``inter``
otherwise.

For a bucket of ``S`` bytes in an allocation of ``N`` GPUs the ideal time is
computed the way the profile's own ``ideal_ms`` was:

* profiles with a meta side file (written by ``jabas profile comm``): the ring
  all-reduce time ``2 (N-1)/N * S / B`` with the bandwidth ``B`` recorded in
  the meta file;
* seed profiles (no meta file): the seed's formula ``4 (N-1)/N * S / B`` with
  the bandwidth of the config (the server's ``intra_bandwidth``, or the lowest
  ``inter_bandwidth`` of the allocation). The seed never recorded which
  bandwidth and world size produced its ``ideal_ms``, so this abscissa can be on
  another scale than the profile's; that is the seed's known flaw, which the
  meta file fixes.

When the profile's meta file records ``after_wait_ms`` (all-reduces that the
last rank entered while the others already waited, blocked, as in training),
the median excess over the plain all-reduce (``wake``) is added to the last
bucket's all-reduce: the ranks that finished their backward first wait in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jabascli.errors import InputError
from jabascli.perfmodel.fit import LinearFit
from jabascli.profiles import CommProfile, ProfileSet, ring_allreduce_ideal_ms
from jabascli.profiles.formats import BUCKET_MB, CommKind, comm_profile_path

MS = 1e-3


def seed_ideal_ms(size_bytes: float, bandwidth: float, world_size: int) -> float:
    """The seed's bandwidth-only all-reduce time, ``4 (N-1)/N * S / B``, in ms."""
    if world_size <= 1:
        return 0.0
    return 4.0 * (world_size - 1) / world_size * size_bytes / bandwidth * 1e3


@dataclass(frozen=True)
class AllReduceFit:
    """``measured_ms = intercept + slope * ideal_ms`` for one kind of link."""

    kind: CommKind
    line: LinearFit
    bandwidth: float | None
    """Bytes/s behind the profile's ``ideal_ms`` (its meta file); None for seed profiles."""
    wake_s: float = 0.0
    """What an all-reduce costs more when the other ranks entered it first and wait, blocked: the median
    over sizes of ``after_wait_ms - measured_ms`` (meta file; 0 when not measured, as in seed profiles)."""

    @classmethod
    def from_profile(cls, profile: CommProfile) -> AllReduceFit:
        bandwidth = profile.meta.bandwidth if profile.meta is not None else None
        wake = 0.0
        after = profile.meta.after_wait_ms if profile.meta is not None else None
        if after and len(after) == len(profile.measured_ms):
            wake = max(0.0, float(np.median(np.subtract(after, profile.measured_ms)))) * MS
        return cls(profile.kind, LinearFit.least_squares(profile.ideal_ms, profile.measured_ms), bandwidth, wake)

    def ideal_ms(self, size_bytes: float, world_size: int, config_bandwidth: float) -> float:
        if self.bandwidth is not None:
            return ring_allreduce_ideal_ms(size_bytes, self.bandwidth, world_size)
        return seed_ideal_ms(size_bytes, config_bandwidth, world_size)

    def time_s(self, size_bytes: float, world_size: int, config_bandwidth: float) -> float:
        """Predicted all-reduce time of one message, never negative."""
        ideal = self.ideal_ms(size_bytes, world_size, config_bandwidth)
        return max(0.0, float(self.line(ideal))) * MS


@dataclass(frozen=True)
class BucketTimes:
    """All-reduce times of the gradient buckets of one iteration, in gradient-ready order."""

    per_bucket_s: tuple[float, ...]
    last_share: float
    """The last bucket's share of the gradient bytes: the part of the update ``overlap`` leaves exposed."""

    @property
    def overlapped_s(self) -> float:
        """All-reduce time of every bucket but the last: it runs while backward still computes."""
        return float(sum(self.per_bucket_s[:-1]))

    @property
    def last_s(self) -> float:
        """All-reduce time of the last bucket: it starts only when backward has finished."""
        return self.per_bucket_s[-1] if self.per_bucket_s else 0.0


@dataclass(frozen=True)
class CommModel:
    """The all-reduce fits and the gradient buckets of one model."""

    fits: dict[CommKind, AllReduceFit]
    bucket_mib: tuple[float, ...] | None
    folders: dict[str, Path]

    @classmethod
    def from_profiles(cls, profiles: ProfileSet, folders: dict[str, Path] | None = None) -> CommModel:
        folders = {**profiles.folders, **(folders or {})}
        fits = {kind: AllReduceFit.from_profile(p) for kind, p in profiles.comm.items()}
        buckets = tuple(profiles.bucket.bucket_size_distribution) if profiles.bucket is not None else None
        if buckets is not None and (not buckets or sum(buckets) <= 0):
            raise InputError.at(folders.get("bucket"), "bucket_size_distribution", "no gradient bytes in the buckets")
        return cls(fits, buckets, folders)

    def last_share(self) -> float:
        """The last bucket's share of all gradient bytes (1 when buckets were not profiled)."""
        if self.bucket_mib is None:
            return 1.0
        return self.bucket_mib[-1] / sum(self.bucket_mib)

    def buckets(self, world_size: int, servers: int, config_bandwidth: float) -> BucketTimes:
        """Bucket all-reduce times in an allocation of ``world_size`` GPUs on ``servers`` servers."""
        if world_size <= 1:
            return BucketTimes((), self.last_share())
        if self.bucket_mib is None:
            folder = self.folders.get("bucket", Path("bucket_profile_data"))
            raise InputError.at(folder, None, "no bucket profile: run `jabas profile bucket` (needed with >1 GPU)")
        kind: CommKind = "intra" if servers <= 1 else "inter"
        fit = self.fits.get(kind)
        if fit is None:
            where = comm_profile_path(self.folders.get("communication", Path("comm_profile_data")), kind)
            if kind == "intra":
                how = "`jabas profile all -c CONFIG`, or `jabas profile comm -c CONFIG --nprocs N` on that server"
                what = "one server"
            else:
                how = (
                    "`jabas profile all -c CONFIG` when the servers are on this machine, or "
                    "`jabas profile comm -c CONFIG --server NAME --rank R --world W --master ADDR:PORT` "
                    "on every server at once (`jabas profile all --server NAME` prints them)"
                )
                what = "several servers"
            raise InputError.at(where, None, f"no {kind}-node all-reduce profile, needed for {what}: run {how}")
        times = [fit.time_s(mib * BUCKET_MB, world_size, config_bandwidth) for mib in self.bucket_mib]
        times[-1] += fit.wake_s  # the last bucket's all-reduce is where ranks that finished first wait
        return BucketTimes(tuple(times), self.last_share())
