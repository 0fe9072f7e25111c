"""The plan ``jabas run`` solves for itself, when it is given a GBS and no plan file.

Rule: with no plan file (``--plan`` or ``[job] plan``), a GBS (``--gbs``, else
``[batching] initial_gbs`` of a job whose ``metric`` is ``fixed``: an adaptive
job reaches its ``initial_gbs`` by its own replanning) and a computation
profile folder on disk, ``jabas run`` trains the solver's plan for that GBS
(:meth:`Solver.solve`) instead of the config's per-server ``vsw``/``ga``. The solver needs profiles for every
available server; a missing one is bad input naming the command that makes
it (``jabas profile all``). Without a GBS, or without any profiles, the
config's plan is trained as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.solver.plan import Plan
from jabascli.solver.setup import solver_from_config


@dataclass(frozen=True)
class RunPlan:
    plan: Plan
    source: str
    """Where the GBS came from: ``--gbs`` or ``[batching] initial_gbs``."""


def solve_for_run(loaded: LoadedConfig, gbs: int | None = None, has_plan_file: bool = False) -> RunPlan | None:
    """The solver's plan for ``jabas run``, or None when the config's plan is to be trained."""
    if has_plan_file:
        if gbs is not None:
            raise InputError.at(None, "--gbs", "a plan file fixes the GBS already: give --gbs or --plan, not both")
        return None
    source = "--gbs"
    batching = loaded.config.batching
    if gbs is None and batching.metric == "fixed":
        # An adaptive job starts from initial_gbs by its own replanning; --gbs still asks for a solved start.
        gbs, source = batching.initial_gbs, "[batching] initial_gbs"
    if gbs is None:
        return None
    if not loaded.profile_dirs().computation.is_dir():
        if source == "--gbs":
            raise InputError.at(
                loaded.profile_dirs().computation,
                None,
                f"no profiles to solve a plan for --gbs {gbs}: run `jabas profile all -c {loaded.path}` first",
            )
        return None
    solver = solver_from_config(loaded)
    return RunPlan(solver.solve(gbs), source)
