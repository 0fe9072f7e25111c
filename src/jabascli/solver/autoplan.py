"""The plan ``jabas run`` solves for itself, when it is given a GBS and no plan file.

Rule: with no plan file (``--plan`` or ``[job] plan``), a GBS (``--gbs``, else
``[batching] initial_gbs`` of a job whose ``metric`` is ``fixed``: an adaptive
job reaches its ``initial_gbs`` by its own replanning) and a computation
profile folder on disk, ``jabas run`` trains the solver's plan for that GBS
(:meth:`Solver.solve`) instead of the config's per-server ``vsw``/``ga``, on
the servers ``--servers`` selects (default ``auto``: a server that would make
the job slower is left out, :mod:`jabascli.solver.choice`). The solver needs profiles for every
available server; a missing one is bad input naming the command that makes
it (``jabas profile all``). Without a GBS, or without any profiles, the
config's own plan is trained (the plan file, else each server's VSW and GA).

A job with ``[parallel] plan = "auto"`` gets the hybrid planner's plan instead
(:func:`jabascli.hybrid.job.plan_for_run`: ``jabas solve --hybrid`` for that
GBS, from ``<profiles>/hybrid/``), whose ``parallel`` the trainers take over the
config's keys; the hybrid search picks its own servers (``--servers`` is not
taken), and a missing hybrid profile is bad input naming ``jabas profile hybrid``.
"""

from __future__ import annotations

from dataclasses import dataclass

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.solver.choice import ALL, AUTO, ServerChoice, choose_plan
from jabascli.solver.plan import Plan


@dataclass(frozen=True)
class RunPlan:
    plan: Plan
    source: str
    """Where the GBS came from: ``--gbs`` or ``[batching] initial_gbs``."""
    choice: ServerChoice | None = None
    """How the servers were chosen (and what leaving some out gains)."""


def solve_for_run(
    loaded: LoadedConfig, gbs: int | None = None, has_plan_file: bool = False, servers: str | None = None
) -> RunPlan | None:
    """The solver's plan for ``jabas run``, or None when the config's plan is to be trained."""
    if has_plan_file:
        if servers not in (None, AUTO):
            raise InputError.at(None, "--servers", "a plan file names its servers already: give --servers or --plan")
        if gbs is not None:
            raise InputError.at(None, "--gbs", "a plan file fixes the GBS already: give --gbs or --plan, not both")
        return None
    source = "--gbs"
    batching = loaded.config.batching
    if gbs is None and batching.metric == "fixed":
        # An adaptive job starts from initial_gbs by its own replanning; --gbs still asks for a solved start.
        gbs, source = batching.initial_gbs, "[batching] initial_gbs"
    auto = loaded.config.hybrid_auto
    if gbs is None and auto and (batching.initial_gbs or batching.gbs_min):
        # An adaptive job's layout is the hybrid planner's too: solved for the GBS it starts from; its
        # replanning then takes the planner's plans for the GBS it moves to (adaptive/replan.py).
        gbs = batching.initial_gbs or batching.gbs_min
        source = "[batching] initial_gbs" if batching.initial_gbs else "[batching] gbs_min"
    if gbs is not None and auto:
        # The hybrid planner reads its own profiles: a model no device holds whole has no computation profiles.
        from jabascli.hybrid.job import plan_for_run

        if servers not in (None, AUTO):
            raise InputError.at(None, "--servers", '[parallel] plan = "auto": the hybrid search picks the servers')
        return RunPlan(plan_for_run(loaded, gbs), source)
    if gbs is None or (source != "--gbs" and not loaded.profile_dirs().computation.is_dir()):
        if servers not in (None, AUTO, ALL):
            raise InputError.at(None, "--servers", "chooses servers for a solved plan: give --gbs and profiles")
        return None
    if not loaded.profile_dirs().computation.is_dir():
        if source == "--gbs":
            raise InputError.at(
                loaded.profile_dirs().computation,
                None,
                f"no profiles to solve a plan for --gbs {gbs}: run `jabas profile all -c {loaded.path}` first",
            )
        return None
    choice = choose_plan(loaded, gbs, servers)
    return RunPlan(choice.plan, source, choice)
