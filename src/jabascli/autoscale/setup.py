"""Build the planner's parts from a loaded job config: allocation space, cost model, objective.

A hybrid job (``[parallel]`` in the config and hybrid profiles under ``<profiles>/hybrid/``) is priced by
:class:`~jabascli.autoscale.hybridcost.HybridCostModel` (the hybrid planner's best plan, or plain IIDP's time
when faster and plain profiles exist); every other job by the data-parallel solver
(:class:`~jabascli.autoscale.costmodel.SolverCostModel`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jabascli.autoscale.allocation import AllocationSpace
from jabascli.autoscale.costmodel import SolverCostModel
from jabascli.autoscale.hybridcost import HybridCostModel
from jabascli.autoscale.planner import Objective, Planner
from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.hybrid.job import load_job, model_name, profiles_root
from jabascli.perfmodel import ServerSpec
from jabascli.solver.cluster import server_specs
from jabascli.solver.online import measured_error
from jabascli.solver.setup import performance_model_from_config


@dataclass
class ScalingSetup:
    space: AllocationSpace
    cost_model: SolverCostModel | HybridCostModel
    objective: Objective

    def planner(self, objective: Objective | None = None) -> Planner:
        return Planner(self.space, self.cost_model, objective or self.objective)


def is_hybrid(loaded: LoadedConfig) -> bool:
    """``[parallel]`` in the config and hybrid profiles beside the others: the hybrid planner prices it."""
    return loaded.config.parallel is not None and (profiles_root(loaded) / "hybrid").is_dir()


def scaling_from_config(loaded: LoadedConfig, *, warm_gbs: int | None = None) -> ScalingSetup:
    """The available servers with their profiles and prices, and the cost model of the job's kind."""
    config = loaded.config
    hybrid = is_hybrid(loaded)
    plain: SolverCostModel | None = None
    try:
        profiles, model = performance_model_from_config(loaded)
        specs = server_specs(config, profiles)
    except InputError:
        if not hybrid:
            raise
        # A hybrid job profiled for the hybrid planner only: the servers as the config has them, no plain pricing.
        specs = [
            ServerSpec(
                s.name, s.device_type, s.devices, s.device_type, s.intra_bandwidth, s.inter_bandwidth, s.price_per_hour
            )
            for s in config.available()
        ]
        model = None
    space = AllocationSpace.from_config(specs, config.cluster.servers, config.scaling.allocation_unit)
    if config.scaling.objective == "cost" and not any(t.gpu_hour_price > 0 for t in space.types):
        raise InputError.at(
            None,
            "scaling.objective",
            "'cost' needs prices: set price_per_hour (or tflops, for the seed's rule) on the servers",
        )
    if model is not None:
        plain = SolverCostModel(model, space, config.job.weight_sync, warm_gbs=warm_gbs)
    cost_model: SolverCostModel | HybridCostModel
    if hybrid:
        root = profiles_root(loaded)
        job = load_job(loaded, root, model_name(loaded, root))
        cost_model = HybridCostModel(job, space, plain)
    else:
        assert plain is not None
        cost_model = plain
    objective = Objective.from_config(config.scaling)
    error = measured_error(loaded) if model is not None else None
    if error is not None:  # a move must gain more than the model's measured error, and the margin on top
        objective = replace(objective, margin=min(0.95, objective.margin + error))
    return ScalingSetup(space, cost_model, objective)
