"""Performance model: compute, all-reduce and iteration time (numpy only, no torch).

``PerformanceModel(profiles).predict(lbs, weight_sync, groups)`` predicts the
iteration time of an allocation with a breakdown per GPU group; the formulas are
in ``iteration.py`` and ``docs/performance-model.md``.
"""

from jabascli.perfmodel.comm import AllReduceFit, BucketTimes, CommModel, seed_ideal_ms
from jabascli.perfmodel.compute import DeviceModel, build_device_model
from jabascli.perfmodel.fit import LinearFit, VswCurve
from jabascli.perfmodel.iteration import (
    WEIGHT_SYNC_METHODS,
    Allocation,
    Breakdown,
    ServerSpec,
    WeightSyncMethod,
    breakdown,
    iteration_times,
)
from jabascli.perfmodel.model import GroupConfig, GroupPrediction, IterationPrediction, PerformanceModel

__all__ = [
    "WEIGHT_SYNC_METHODS",
    "AllReduceFit",
    "Allocation",
    "Breakdown",
    "BucketTimes",
    "CommModel",
    "DeviceModel",
    "GroupConfig",
    "GroupPrediction",
    "IterationPrediction",
    "LinearFit",
    "PerformanceModel",
    "ServerSpec",
    "VswCurve",
    "WeightSyncMethod",
    "breakdown",
    "build_device_model",
    "iteration_times",
    "seed_ideal_ms",
]
