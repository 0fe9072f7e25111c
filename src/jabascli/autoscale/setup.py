"""Build the planner's parts from a loaded job config: allocation space, cost model, objective."""

from __future__ import annotations

from dataclasses import dataclass

from jabascli.autoscale.allocation import AllocationSpace
from jabascli.autoscale.costmodel import SolverCostModel
from jabascli.autoscale.planner import Objective, Planner
from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.solver.cluster import server_specs
from jabascli.solver.setup import performance_model_from_config


@dataclass
class ScalingSetup:
    space: AllocationSpace
    cost_model: SolverCostModel
    objective: Objective

    def planner(self, objective: Objective | None = None) -> Planner:
        return Planner(self.space, self.cost_model, objective or self.objective)


def scaling_from_config(loaded: LoadedConfig, *, warm_gbs: int | None = None) -> ScalingSetup:
    """The available servers with their profiles and prices, and the profile-based cost model (the hybrid
    planner's, :mod:`jabascli.autoscale.hybridcost`, for a ``[parallel] plan = "auto"`` job)."""
    profiles, model = performance_model_from_config(loaded)
    config = loaded.config
    specs = server_specs(config, profiles)
    space = AllocationSpace.from_config(specs, config.cluster.servers, config.scaling.allocation_unit)
    if config.scaling.objective == "cost" and not any(t.gpu_hour_price > 0 for t in space.types):
        raise InputError.at(
            None,
            "scaling.objective",
            "'cost' needs prices: set price_per_hour (or tflops, for the seed's rule) on the servers",
        )
    if config.parallel is not None and config.parallel.plan == "auto":
        # The job trains the hybrid planner's plan wherever it goes: price each allocation with it.
        from jabascli.autoscale.hybridcost import HybridCostModel

        cost_model: SolverCostModel = HybridCostModel(loaded, model, space, config.job.weight_sync, warm_gbs=warm_gbs)
    else:
        cost_model = SolverCostModel(model, space, config.job.weight_sync, warm_gbs=warm_gbs)
    return ScalingSetup(space, cost_model, Objective.from_config(config.scaling))
