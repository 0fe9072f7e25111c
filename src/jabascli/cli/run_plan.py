"""``jabas run``'s own plan: solved from the profiles for a GBS, and its prediction checked at the end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.cli.common import console
from jabascli.config import LoadedConfig
from jabascli.solver.autoplan import RunPlan
from jabascli.solver.plan import Plan


@dataclass(frozen=True)
class OwnPlan:
    plan: Plan
    path: Path
    """Where the plan was written (the run folder), for the trainers and for the record."""


def plan_own_run(
    loaded: LoadedConfig, gbs: int | None, plan_file: Path | None, servers: str | None = None
) -> RunPlan | None:
    """The solver's plan for ``jabas run`` (see :mod:`jabascli.solver.autoplan`); nothing is written."""
    from jabascli.solver.autoplan import solve_for_run

    has_plan_file = plan_file is not None or loaded.config.job.plan is not None
    return solve_for_run(loaded, gbs, has_plan_file, servers)


def write_own_plan(loaded: LoadedConfig, solved: RunPlan, quiet: bool) -> OwnPlan:
    """Write ``solved``'s plan to the run folder, for the trainers and for the record, and say what it is."""
    from jabascli.engine.layout import run_folder
    from jabascli.solver.plan import write_plan

    path = write_plan(run_folder(loaded) / "plan.json", solved.plan)
    if not quiet:
        p = solved.plan
        predicted = f", predicted {p.iteration_time_s * 1e3:.1f} ms per iteration" if p.iteration_time_s else ""
        console.print(
            f"plan solved for GBS {p.gbs} ({solved.source}): LBS {p.lbs_text()}, {p.seed_form()}, "
            f"weight sync {p.weight_sync}{predicted}",
            highlight=False,
            markup=False,
        )
        if p.parallel is not None:
            lay = p.parallel
            ckpt = lay.checkpointing if isinstance(lay.checkpointing, str) else f"blocks {lay.checkpointing}"
            console.print(
                f"hybrid layout (the planner's): tp {lay.tp}, pp {lay.pp}, stages {lay.stages}, "
                f"sharding {lay.sharding}, checkpointing {ckpt}",
                highlight=False,
                markup=False,
            )
        from jabascli.solver.online import job_refit

        in_use = job_refit(loaded) if p.parallel is None else None
        if in_use is not None:
            console.print(in_use.line(), highlight=False, markup=False)
        left_out = solved.choice.line() if solved.choice is not None else None
        if left_out is not None:
            console.print(f"{left_out} (--servers all keeps every server)", highlight=False, markup=False)
    return OwnPlan(solved.plan, path)


def report_predicted(loaded: LoadedConfig, own: OwnPlan, start: dict[str, Any], quiet: bool = False) -> None:
    """``predicted 23.6 ms, measured 24.1 ms per iteration (+2%)``: the model against the run; then the refit.

    The run's measurement refits the job's performance model (:mod:`jabascli.solver.online`): a new generation
    in the run folder, which the next run of the job starts from. ``quiet``: refit, print nothing.
    """
    import os

    from jabascli.engine.layout import run_folder
    from jabascli.engine.metrics import median_busy_s, median_iteration_s
    from jabascli.errors import InputError
    from jabascli.solver.online import learn_from_run

    predicted = own.plan.iteration_time_s
    first_step = int(start.get("step", 0))
    measured = median_iteration_s(run_folder(loaded) / "steps.csv", first_step=first_step)
    if predicted is None or measured is None:
        if not quiet:
            console.print("predicted and measured iteration time: too few iterations to compare", highlight=False)
        return
    median, count = measured
    error = (median - predicted) / predicted * 100
    if not quiet:
        console.print(
            f"predicted {predicted * 1e3:.1f} ms, measured {median * 1e3:.1f} ms per iteration ({error:+.0f}%, "
            f"median of {count} iterations)",
            highlight=False,
        )
    if own.plan.parallel is not None or loaded.config.batching.metric != "fixed":
        return  # a hybrid layout has its own model; an adaptive run's median spans several plans
    try:
        busy = median_busy_s(run_folder(loaded) / "busy.csv", first_step=first_step)
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
        learned = learn_from_run(loaded, own.plan, median, count, load=load, cpus=cpus, busy=busy)
    except InputError as exc:
        if not quiet:
            console.print(f"performance model not refit: {exc}", highlight=False, markup=False)
        return
    if quiet:
        return
    r = learned.record
    last = r.observations[-1]
    note = f"; host busy (load {last.load:.1f}): weighed as the profile" if last.disturbed else ""
    busy_times = ", ".join(f"{a.server} {a.busy_s * 1e3:.1f} ms" for a in last.assignments if a.busy_s)
    if busy_times and len(last.assignments) > 1:
        console.print(f"busy time per GPU before the last all-reduce: {busy_times}", highlight=False, markup=False)
    console.print(
        f"performance model refit to {len(r.observations)} {'run' if len(r.observations) == 1 else 'runs'}: "
        f"predicts {learned.predicted_after_s * 1e3:.1f} ms for this plan ({r.error_after * 100:+.0f}% off, "
        f"{error:+.0f}% before){note}; generation {r.generation}, {learned.path}, where the next run starts",
        highlight=False,
        markup=False,
    )
