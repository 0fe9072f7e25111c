"""The iteration-time formula of one GPU, and the allocation it runs in.

For a GPU running ``v`` VSWs with ``g`` extra GA micro-steps (seconds; see
``docs/performance-model.md``)::

    data    = (g + 1) * D(v)             forward  = (g + 1) * F(v)
    backward = (g + 1) * B(v)
    comm    = max(B(1), A_overlapped) - B(1) + A_last       # exposed all-reduce
    update  = U + C * (v - 1)            (sequential)
            = X + C * (v - 1)            (overlap, X measured by the profiler)
            = (U + C * (v - 1)) * share_last                (overlap, seed profiles)
    bn_sync = bn * v
    overhead = O                         # the engine's own work, once per iteration
    sync_wait = S(v) * sqrt(g + 1) / sqrt(pi)   (with other ranks; 0 alone)
    T(v, g) = data + forward + backward + comm + update + bn_sync + overhead + sync_wait

``A_overlapped`` is the all-reduce time of every bucket but the last (it runs
during the backward of the rank's last micro-step, one worker's micro-batch:
``B(1)``, whatever the VSW and GA counts), ``A_last`` that of the last bucket,
``share_last`` the last bucket's share of the gradient bytes. The cluster's
iteration time is the largest ``T`` over its GPUs.

``sync_wait``: a synchronous iteration ends when the slowest rank *of that
iteration* is done, and ranks' times vary from one iteration to the next, so
its expected time is the expected maximum of the ranks' times, above the
largest mean. For two ranks of equal mean and standard deviation ``s`` that
excess is ``s / sqrt(pi)``; each rank is charged it with its own ``s``:
``S(v)``, the standard deviation of one iteration of ``v`` VSWs from the
profile's quartiles, grown as ``sqrt(g + 1)`` for ``g + 1`` independent
micro-step rounds. Being a per-rank term, it keeps the cluster time the
largest ``T`` (the solver stays exact); a plan bound by one rank is then
over-predicted by at most that rank's ``S / sqrt(pi)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from jabascli.perfmodel.comm import BucketTimes
from jabascli.perfmodel.compute import DeviceModel
from jabascli.perfmodel.fit import FloatArray

WeightSyncMethod = Literal["sequential", "overlap"]
WEIGHT_SYNC_METHODS: tuple[WeightSyncMethod, ...] = ("sequential", "overlap")
SYNC_WAIT_PER_SIGMA = 1.0 / math.sqrt(math.pi)  # E[max(X, Y)] - mean, for X, Y ~ N(mean, s^2): s / sqrt(pi)


@dataclass(frozen=True)
class ServerSpec:
    """A server as the model sees it: its devices and links, and whose profiles describe them."""

    name: str
    device_type: str
    devices: int
    profile_server: str
    intra_bandwidth: float
    inter_bandwidth: float
    price_per_hour: float = 0.0


@dataclass(frozen=True)
class Allocation:
    """What the all-reduce depends on: how many GPUs, on how many servers, over which links."""

    world_size: int
    servers: int
    bandwidth: float
    """Bytes/s from the config: the server's intra-node bandwidth when ``servers == 1``,
    else the lowest inter-node bandwidth (used only with seed profiles, see ``comm.py``)."""

    @classmethod
    def of(cls, used: Iterable[tuple[ServerSpec, int]]) -> Allocation:
        """The allocation of ``(server, GPUs used on it)`` pairs; servers with 0 GPUs are not in it."""
        merged: dict[str, tuple[ServerSpec, int]] = {}
        for server, gpus in used:
            if gpus > 0:
                merged[server.name] = (server, merged.get(server.name, (server, 0))[1] + gpus)
        if not merged:
            raise ValueError("an allocation needs at least one GPU")
        specs = [s for s, _ in merged.values()]
        world = sum(g for _, g in merged.values())
        if len(specs) == 1:
            return cls(world, 1, specs[0].intra_bandwidth)
        return cls(world, len(specs), min(s.inter_bandwidth for s in specs))


@dataclass(frozen=True)
class Breakdown:
    """Predicted iteration time of one GPU, by phase (seconds)."""

    data_s: float
    forward_s: float
    backward_s: float
    exposed_comm_s: float
    update_s: float
    bn_sync_s: float
    overhead_s: float = 0.0
    sync_wait_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s

    @property
    def busy_s(self) -> float:
        """The GPU's busy time: its computation and the engine's own work, what it does before it can only
        wait for the others (measured per rank, ``docs/performance-model.md``)."""
        return self.compute_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return _total(
            self.data_s,
            self.forward_s,
            self.backward_s,
            self.exposed_comm_s,
            self.update_s,
            self.bn_sync_s,
            self.overhead_s,
            self.sync_wait_s,
        )


def _total(data, forward, backward, comm, update, bn_sync, overhead, sync_wait):  # type: ignore[no-untyped-def]
    # One summation order for scalars and arrays, so that the solver's tables and
    # a single prediction give bit-identical times.
    return data + forward + backward + comm + update + bn_sync + overhead + sync_wait


def _components(
    device: DeviceModel, vsw: ArrayLike, ga: ArrayLike, weight_sync: WeightSyncMethod, buckets: BucketTimes
) -> tuple[FloatArray, ...]:
    v = np.asarray(vsw, dtype=np.float64)
    steps = np.asarray(ga, dtype=np.float64) + 1.0
    d, f, b = device.phases(v)
    # Only the rank's last micro-step, one worker's micro-batch on replica 0, runs DDP's synchronising
    # backward (engine/vsw.py): the buckets' all-reduces overlap that one backward, B(1), not the other
    # VSWs' or GA steps' (B(v) hid a 94 ms all-reduce behind 8 VSWs' backward on a 100mbit link).
    b_sync = device.backward(np.ones_like(v))
    comm = np.maximum(b_sync, buckets.overlapped_s) - b_sync + buckets.last_s
    update = device.update_s + device.copy_s(v)
    if weight_sync == "overlap":
        if device.overlap_update_s is None:
            update = update * buckets.last_share  # the seed's assumption: only the last bucket's share is exposed
        else:
            update = device.overlap_update_s + device.copy_s(v)  # measured; the copy follows the last bucket
    elif weight_sync != "sequential":
        raise ValueError(f"weight sync must be 'sequential' or 'overlap', got {weight_sync!r}")
    overhead = np.full(np.broadcast(v, steps).shape, device.overhead_s)
    synchronised = len(buckets.per_bucket_s) > 0  # other ranks to wait for
    sync_wait = device.spread_s(v) * np.sqrt(steps) * SYNC_WAIT_PER_SIGMA if synchronised else overhead * 0.0
    return steps * d, steps * f, steps * b, comm, update, device.bn_sync_s * v, overhead, sync_wait


def iteration_times(
    device: DeviceModel, vsw: ArrayLike, ga: ArrayLike, weight_sync: WeightSyncMethod, buckets: BucketTimes
) -> FloatArray:
    """``T(v, g)`` for arrays of VSW counts and GA steps (broadcast together)."""
    return np.asarray(_total(*_components(device, vsw, ga, weight_sync, buckets)), dtype=np.float64)


def breakdown(device: DeviceModel, vsw: int, ga: int, weight_sync: WeightSyncMethod, buckets: BucketTimes) -> Breakdown:
    """``T(v, g)`` of one GPU, by phase; ``breakdown(...).total_s == iteration_times(...)`` exactly."""
    return Breakdown(*(float(x) for x in _components(device, vsw, ga, weight_sync, buckets)))
