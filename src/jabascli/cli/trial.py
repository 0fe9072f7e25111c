"""``jabas run``'s runner-up trial: when the model cannot tell plans apart, train a few iterations of each.

When the job's model has a measured error ``e`` (its latest refit generation
holds a run whose measured iteration time was ``e`` off what the model that
planned it predicted, or the refit itself misses a run it was fit to by ``e``:
:func:`jabascli.solver.online.measured_error`) and runner-up plans for the GBS
are predicted within ``e`` of the best one, ``jabas run`` trains ``TRIAL_STEPS``
iterations of the best plan, then ``TRIAL_STEPS`` of each runner-up, each
resumed from the checkpoint the one before wrote, and goes on with the one
whose iterations measured fastest. The trial costs time, not correctness: every
iteration is one of the job's, at its GBS, on its samples, and a resumed run is
exact under any plan of the same GBS (``docs/engine.md``). Every measurement
refits the model, as any run's does.

The candidates: the best plan on every available server when ``--servers
auto`` left some out, else the best plan without one of the plan's servers;
and the best plan of the other kind, IIDP's or the uneven one
(:mod:`jabascli.solver.uneven`), when the choice built both. The runners-up
are those within ``e`` of the best, fastest predicted first, at most
``MAX_RUNNERS_UP``: all of them, not only the closest, because a model ``e``
off cannot rank them either (a benchmark row on a noisy host tried the closest,
IIDP's plan at LBS 64, which measured 0.86x, while the fast server alone,
further behind in the prediction, measured 1.23x the plan it kept).
A job without a refit (its first run) has no measured error: no trial.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.solver.autoplan import RunPlan
from jabascli.solver.plan import Plan

TRIAL_STEPS = 15
"""Iterations of each plan (the first 5 are the measurement's warm-up)."""

MAX_RUNNERS_UP = 2
"""Plans tried beside the best: a trial of three plans costs three trainer starts and 45 iterations."""


@dataclass(frozen=True)
class Trial:
    best: Plan
    runners_up: tuple[Plan, ...]
    """Every candidate predicted within ``error`` of ``best`` (at most ``MAX_RUNNERS_UP``), fastest first."""
    error: float
    """The model's measured error (:func:`jabascli.solver.online.measured_error`)."""

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The plans tried, in order: the best, then the runners-up."""
        return (self.best, *self.runners_up)


def _time(plan: Plan) -> float:
    return plan.iteration_time_s or float("inf")


def plan_trial(loaded: LoadedConfig, solved: RunPlan, max_steps: int | None, first_step: int) -> Trial | None:
    """The trial to run before the rest of the job, or None (see the module doc)."""
    from jabascli.solver.choice import solver_for
    from jabascli.solver.online import measured_error

    best = solved.plan
    if best.parallel is not None or best.iteration_time_s is None or loaded.config.batching.metric != "fixed":
        return None
    # Each plan tried takes TRIAL_STEPS, and the run keeps at least that many for the plan chosen.
    room = MAX_RUNNERS_UP if max_steps is None else min(MAX_RUNNERS_UP, (max_steps - first_step) // TRIAL_STEPS - 2)
    if room < 1:
        return None  # too short a run to try a runner-up
    error = measured_error(loaded)
    if error is None:
        return None
    candidates: list[Plan] = []
    if solved.choice is not None and solved.choice.left_out and solved.choice.with_all is not None:
        candidates.append(solved.choice.with_all)
    else:
        servers = best.servers()
        for left_out in servers if len(servers) > 1 else []:
            try:
                candidates.append(solver_for(loaded, ",".join(s for s in servers if s != left_out)).solve(best.gbs))
            except InputError:
                continue  # no plan reaches the GBS without it
    if solved.choice is not None and solved.choice.alternative is not None:
        candidates.append(solved.choice.alternative)  # IIDP's best beside an uneven plan, or the other way round
    within = [p for p in candidates if _time(p) - _time(best) <= error * _time(best)]
    runners_up = _distinct(best, sorted(within, key=_time))[:room]
    return Trial(best, tuple(runners_up), error) if runners_up else None


def _distinct(best: Plan, plans: list[Plan]) -> list[Plan]:
    """``plans`` without repeats and without ``best`` (one plan can be a candidate twice: the best without a
    server and the other kind's best)."""
    seen = {best.shape()}
    out = []
    for plan in plans:
        if plan.shape() not in seen:
            seen.add(plan.shape())
            out.append(plan)
    return out


@dataclass(frozen=True)
class TrialResult:
    chosen: Plan
    path: Path
    """plan.json in the run folder, now the chosen plan."""
    line: str
    result: Any
    """The last trial run's result (what the run shows when the trial trained the whole job)."""
    start: Any
    """Where the job goes on after the trial (its ``done`` says when nothing is left)."""


def run_trial(loaded: LoadedConfig, trial: Trial, options: Any, start: Any, train: Callable[[Any], Any]) -> TrialResult:
    """Train ``TRIAL_STEPS`` iterations of each plan from ``start`` (``train(options)`` runs the trainers), then
    point ``plan.json`` at the fastest one (the earlier plan on a tie)."""
    from jabascli.engine.layout import run_folder
    from jabascli.engine.metrics import median_busy_s, median_iteration_s
    from jabascli.engine.rerun import choose_start
    from jabascli.solver.online import learn_from_run
    from jabascli.solver.plan import write_plan

    folder = run_folder(loaded)
    measured: list[float | None] = [None] * len(trial.plans)
    result = None
    for i, plan in enumerate(trial.plans):
        if start.done is not None:
            break  # the job ended within the trial
        first = start.step
        path = write_plan(folder / f"plan-trial-{i + 1}.json", plan)
        result = train(replace(options, plan=path, resume=start.resume, max_steps=first + TRIAL_STEPS))
        found = median_iteration_s(folder / "steps.csv", first_step=first)
        if found is not None:
            measured[i] = found[0]
            busy = median_busy_s(folder / "busy.csv", first_step=first)
            load, cpus = os.getloadavg()[0], os.cpu_count() or 1
            with contextlib.suppress(InputError):  # the trial still chooses; the refit is what it would add
                learn_from_run(loaded, plan, found[0], found[1], load=load, cpus=cpus, busy=busy)
        start = choose_start(loaded, resume=None, fresh=False, max_steps=options.max_steps)
    chosen = trial.best
    if measured[0] is not None:  # the best plan stays unless a runner-up measured faster than it
        times = [(t, i) for i, t in enumerate(measured) if t is not None]
        chosen = trial.plans[min(times)[1]]
    path = write_plan(folder / "plan.json", chosen)

    def ms(t: float | None) -> str:
        return f"{t * 1e3:.1f} ms" if t is not None else "not measured"

    predicted = _and([f"{_time(p) * 1e3:.1f}" for p in trial.plans])
    results = [f"{trial.best.seed_form()} measured {ms(measured[0])}"]
    results += [f"{p.seed_form()} {ms(t)}" for p, t in zip(trial.runners_up, measured[1:], strict=True)]
    line = (
        f"runner-up trial (predicted {predicted} ms, within the model's measured error of {trial.error:.0%}): "
        f"{', '.join(results)} over {TRIAL_STEPS} iterations each; kept {chosen.seed_form()}"
    )
    return TrialResult(chosen, path, line, result, start)


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def run_with_trial(
    loaded: LoadedConfig,
    solved: RunPlan | None,
    own: Any,
    options: Any,
    start: Any,
    train: Callable[[Any], Any],
    notes: list[str],
) -> tuple[Any, Any]:
    """``train(options)``, after a runner-up trial when :func:`plan_trial` finds one; the result and the plan
    trained (an ``OwnPlan``). The trial's line goes to ``notes``, shown under the next start line."""
    from jabascli.cli.run_plan import OwnPlan

    trial = plan_trial(loaded, solved, options.max_steps, start.step) if solved is not None and own else None
    if trial is None:
        return train(options), own
    done = run_trial(loaded, trial, options, start, train)
    notes.append(done.line)
    own = OwnPlan(done.chosen, done.path)
    if done.start.done is not None:
        return done.result, own
    return train(replace(options, plan=done.path, resume=done.start.resume)), own
