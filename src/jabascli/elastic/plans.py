"""The plan of an allocation, and which trainers a move keeps: what the scheduler decides a generation with
(:mod:`jabascli.elastic.job`) on a move, a restart and a recovery in place (:mod:`jabascli.elastic.recovery`)."""

from __future__ import annotations

import dataclasses

from jabascli.config import LoadedConfig
from jabascli.engine.plan import TrainingPlan, plan_from_config, plan_from_solver
from jabascli.errors import InputError, Problem


def check_allocation(servers: list[str], known: list[str]) -> None:
    """An InputError naming every server of ``servers`` not in ``known``, or one named twice."""
    unknown = [s for s in servers if s not in known]
    if unknown:
        names = ", ".join(known)
        raise InputError([Problem(None, "servers", f"unknown server {s!r} (known: {names})") for s in unknown])
    if len(set(servers)) != len(servers):
        raise InputError.at(None, "servers", "a server is named twice")


def survivors(old: TrainingPlan, new: TrainingPlan) -> dict[int, int] | None:
    """Old rank -> new rank for the trainers a move can keep; None unless rank 0 stays rank 0.

    A server in both plans keeps its first ranks, in order, so each keeps its local
    rank (and with it its device); rank 0 must stay, as it hosts the job's store.
    """
    kept: dict[int, int] = {}
    for server in {r.server for r in old.ranks} & {r.server for r in new.ranks}:
        before = [r.rank for r in old.ranks if r.server == server]
        after = [r.rank for r in new.ranks if r.server == server]
        kept.update(zip(before, after, strict=False))
    return kept if kept.get(0) == 0 else None


def plan_for(loaded: LoadedConfig, servers: list[str], gbs: int | None = None) -> tuple[TrainingPlan, str]:
    """The plan on ``servers``, and where it came from.

    With ``gbs`` (the job's current GBS) and the job's profiles, the solver's fastest
    plan for these servers at that GBS, so that a move keeps the GBS (an uneven plan where
    the job may train one and it is predicted faster, as ``jabas run`` chooses); otherwise (no
    profiles, or no plan reaches that GBS there) each server's devices with its
    configured VSW and GA at ``[job] lbs``, whose GBS follows the allocation. A ``[parallel] plan = "auto"``
    job gets the hybrid planner's plan instead (:func:`_hybrid_plan_for`), or an InputError naming the servers.
    """
    if loaded.config.hybrid_auto:
        return _hybrid_plan_for(loaded, servers, gbs)
    why = "no GBS to keep"
    if gbs is not None:
        try:
            from jabascli.solver import solver_from_config  # numpy; reads the profiles
            from jabascli.solver.choice import best_plan, uneven_offered

            solver = solver_from_config(loaded, ",".join(servers))
            solved, _ = best_plan(solver, gbs, uneven_offered(loaded))
            return plan_from_solver(solved, "solver", loaded), f"solver plan at GBS {gbs}"
        except InputError as exc:
            why = exc.lines()[0] if exc.lines() else "no solver plan"
    config = loaded.config.model_copy(deep=True)
    config.cluster.available_servers = list(servers)
    return plan_from_config(dataclasses.replace(loaded, config=config)), f"configured VSW/GA ({why})"


def _hybrid_plan_for(loaded: LoadedConfig, servers: list[str], gbs: int | None) -> tuple[TrainingPlan, str]:
    """A ``[parallel] plan = "auto"`` job's plan on ``servers``: the hybrid planner's (``jabas solve --hybrid``
    restricted to them), so that the layout follows the servers. The GBS kept is ``gbs``, else ``[batching]
    initial_gbs``, else the configured VSW/GA's on these servers. No plan fitting them is an InputError naming them.
    """
    from jabascli.hybrid.job import plan_for_run  # reads the hybrid profiles

    config = loaded.config.model_copy(deep=True)
    config.cluster.available_servers = list(servers)
    there = dataclasses.replace(loaded, config=config)
    target = gbs or loaded.config.batching.initial_gbs or plan_from_config(there).gbs
    try:
        solved = plan_for_run(there, target)
    except InputError as exc:
        why = exc.lines()[0] if exc.lines() else "no plan fits"
        raise InputError.at(
            None, "servers", f"no hybrid plan for GBS {target} fits servers {', '.join(servers)}: {why}"
        ) from exc
    parallel = solved.parallel
    layout = f"tp {parallel.tp}, pp {parallel.pp}, sharding {parallel.sharding}" if parallel else "plain"
    return plan_from_solver(solved, "hybrid planner", loaded), f"hybrid plan at GBS {target} ({layout})"
