"""The auto-scaler's cost model for a ``[parallel] plan = "auto"`` job: the hybrid planner's predictions.

Such a job trains the hybrid planner's plan on whichever servers it is moved to
(:func:`jabascli.elastic.job.plan_for`), so the time an allocation is charged is
that plan's predicted iteration time: :func:`jabascli.hybrid.job.solve` on the
allocation's servers (:meth:`AllocationSpace.used`, whole servers: the elastic
runtime moves whole servers, so, as for the solver's model, the figures are
exact when ``[scaling] allocation_unit`` is each server's GPU count). No plan
fitting the allocation at that GBS (memory, or a GBS the planner cannot deal to
its devices) is ``inf``: the planner never moves the job there. The time is the
planner's own figure, so ``lower_bound`` is the same value (it is exact).

The allocation space and the GBS step still come from the job's computation
profiles (:func:`jabascli.autoscale.setup.scaling_from_config`); only the
iteration times are the hybrid planner's.
"""

from __future__ import annotations

import dataclasses
import math

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import SolverCostModel
from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.hybrid.job import HybridJob, load_job, model_name, profiles_root, solve
from jabascli.perfmodel import PerformanceModel


class HybridCostModel(SolverCostModel):
    """Iteration times of the hybrid planner's plan on each allocation, cached (the solver's parts stay for
    the space and the GBS step the auto-scaler reads from ``model``)."""

    def __init__(
        self,
        loaded: LoadedConfig,
        model: PerformanceModel,
        space: AllocationSpace,
        weight_sync: str = "recommend",
        *,
        warm_gbs: int | None = None,
    ) -> None:
        super().__init__(model, space, weight_sync, warm_gbs=warm_gbs)
        self.loaded = loaded
        self.root = profiles_root(loaded)
        self._jobs: dict[Choice, HybridJob] = {}
        self._hybrid_times: dict[tuple[Choice, int], float] = {}

    def job(self, choice: Choice) -> HybridJob:
        """The hybrid planner's view of the allocation's servers (its profiles read once per allocation)."""
        if choice not in self._jobs:
            config = self.loaded.config.model_copy(deep=True)
            config.cluster.available_servers = list(self.space.used(choice))
            there = dataclasses.replace(self.loaded, config=config)
            self._jobs[choice] = load_job(there, self.root, model_name(there, self.root))
        return self._jobs[choice]

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        key = (choice, gbs)
        if key not in self._hybrid_times:
            try:
                self._hybrid_times[key] = solve(self.job(choice), gbs).prediction.iteration_s
            except InputError:  # nothing fits there at this GBS
                self._hybrid_times[key] = math.inf
        return self._hybrid_times[key]

    def lower_bound(self, choice: Choice, gbs: int) -> float:
        return self.iteration_time(choice, gbs)
