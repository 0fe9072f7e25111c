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
            f"plan solved for GBS {p.gbs} ({solved.source}): LBS {p.lbs}, {p.seed_form()}, "
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
        left_out = solved.choice.line() if solved.choice is not None else None
        if left_out is not None:
            console.print(f"{left_out} (--servers all keeps every server)", highlight=False, markup=False)
    return OwnPlan(solved.plan, path)


def report_predicted(loaded: LoadedConfig, own: OwnPlan, start: dict[str, Any]) -> None:
    """``predicted 23.6 ms, measured 24.1 ms per iteration (+2%)``: the model against the run."""
    from jabascli.engine.layout import run_folder
    from jabascli.engine.metrics import median_iteration_s

    predicted = own.plan.iteration_time_s
    measured = median_iteration_s(run_folder(loaded) / "steps.csv", first_step=int(start.get("step", 0)))
    if predicted is None or measured is None:
        console.print("predicted and measured iteration time: too few iterations to compare", highlight=False)
        return
    median, count = measured
    error = (median - predicted) / predicted * 100
    console.print(
        f"predicted {predicted * 1e3:.1f} ms, measured {median * 1e3:.1f} ms per iteration ({error:+.0f}%, "
        f"median of {count} iterations)",
        highlight=False,
    )
