"""Bad ``[batching]`` input, found before any trainer starts (``jabas run``) or as a trainer starts.

* (``gbs_min`` above ``gbs_max`` and ``initial_gbs`` outside the bounds are
  refused when the config is loaded, with an unknown ``metric`` or ``lr_scaling``);
* ``metric = "goodput"`` without profiles for every device type (its
  throughput is the solver's prediction), unless the hybrid planner re-plans
  the job (``[parallel] plan = "auto"`` with hybrid profiles: its predictions);
* bounds that no plan for the job's servers reaches: the message names the
  bound and the smallest (or largest) GBS that is reachable.
"""

from __future__ import annotations

# With check_batching, the launcher hands the hybrid plans it checked to its trainers (torch-free, as this module).
from jabascli.adaptive.hybrid_plans import hand_off_plans as hand_off_plans
from jabascli.adaptive.replan import hybrid_candidates, solver_candidates
from jabascli.config import LoadedConfig
from jabascli.engine.plan import TrainingPlan
from jabascli.errors import InputError

UNBOUNDED = 1 << 16
"""The upper end of GBS searched when ``gbs_max`` is not set (the trainer also caps it at the dataset)."""


def check_batching(loaded: LoadedConfig, plan: TrainingPlan) -> None:
    b = loaded.config.batching
    if b.metric == "fixed":
        return
    path = loaded.path
    low, high = b.gbs_min or 1, b.gbs_max or UNBOUNDED
    if hybrid_candidates(loaded, plan, low, min(high, UNBOUNDED)):
        return  # the hybrid planner's plans: each within the bounds, with its predicted throughput (goodput)
    solver = solver_candidates(loaded, plan, 1, high)
    if b.metric == "goodput" and solver is None:
        raise InputError.at(
            path,
            "batching.metric",
            "goodput needs the solver's predicted throughput: profiles for every device type of the job's servers "
            "([profiles], written by `jabas profile`); use similarity or noise_scale without them",
        )
    if solver is None:  # the fallback: any GBS from one sample per rank up (GA is unbounded)
        if high < plan.world_size:
            smallest = f"{plan.world_size}, one sample on each of the {plan.world_size} ranks"
            raise InputError.at(path, "batching.gbs_max", f"{high} is below the smallest reachable GBS ({smallest})")
        return
    reachable = sorted(c.plan.gbs for c in solver)
    if any(low <= g <= high for g in reachable):
        return
    if reachable:
        largest = f"the largest GBS the solver reaches up to gbs_max on these servers is {reachable[-1]}"
        raise InputError.at(path, "batching.gbs_min", f"{low} is above every reachable GBS ({largest})")
    above = sorted(c.plan.gbs for c in solver_candidates(loaded, plan, high + 1, max(4 * high, UNBOUNDED)) or [])
    smallest = f"the smallest the solver reaches on these servers is {above[0]}" if above else "the solver finds none"
    raise InputError.at(path, "batching.gbs_max", f"{high} is below every reachable GBS ({smallest})")
