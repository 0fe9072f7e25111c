"""Configuration solver (numpy only, no torch).

``Solver(model, servers, allocation_unit, weight_sync).solve(gbs)`` returns the
fastest :class:`Plan` under the performance model, exactly;
``solver_from_config`` builds one from a loaded job config. See ``docs/solver.md``.
"""

from jabascli.solver.bottleneck import BottleneckTable, minmax_convolve
from jabascli.solver.plan import Assignment, Plan, read_plan, write_plan
from jabascli.solver.setup import solver_from_config
from jabascli.solver.solve import Solver, weight_sync_methods

__all__ = [
    "Assignment",
    "BottleneckTable",
    "Plan",
    "Solver",
    "minmax_convolve",
    "read_plan",
    "solver_from_config",
    "weight_sync_methods",
    "write_plan",
]
