"""A job's online performance model: its latest refit applied to the profiles, and a new refit after a run.

:func:`refit_in_use` finds the job's latest refit generation made on the
measured profiles as they are now (in its run folder, else in the newest run
folder ``jabas run --fresh`` moved aside: the refit describes the servers, not
the training state); :func:`~jabascli.solver.setup.performance_model_from_config`
applies it, so every decision that builds the model from the config (the plan
``jabas run`` solves, adaptive batching's replans and goodput, the auto-scaler's
cost model) starts from it. :func:`learn_from_run` adds a run's measurement and
writes the next generation (the fit: :mod:`jabascli.perfmodel.online`; the
file: :mod:`jabascli.profiles.refit`).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.perfmodel import GroupConfig
from jabascli.perfmodel.online import PRIOR_ITERATIONS, Observation, Refit, errors, fingerprint, fit, predict
from jabascli.profiles import ProfileSet, load_profile_set
from jabascli.profiles.refit import (
    ObservedAssignment,
    ObservedPlan,
    RefitRecord,
    read_refit,
    refit_generations,
    write_refit,
)
from jabascli.solver.cluster import server_specs
from jabascli.solver.plan import Plan


@dataclass(frozen=True)
class InUse:
    record: RefitRecord
    path: Path

    @property
    def refit(self) -> Refit:
        return Refit(
            dict(self.record.compute), dict(self.record.comm), {s: dict(f) for s, f in self.record.lbs.items()}
        )

    def line(self) -> str:
        """``performance model: refit generation 2 from 3 runs (fast compute x0.94 (at LBS 64 x1.01, 256 x0.73),
        inter all-reduce x1.40), runs/job/perfmodel/refit-2.json``."""
        runs = len(self.record.observations)
        factors = ", ".join(
            [_compute_factor(s, a, self.record.lbs.get(s, {})) for s, a in sorted(self.record.compute.items())]
            + [f"{k} all-reduce x{c:.2f}" for k, c in sorted(self.record.comm.items())]
        )
        return (
            f"performance model: refit generation {self.record.generation} from {runs} "
            f"{'run' if runs == 1 else 'runs'} ({factors or 'every term at the profile'}), {self.path}"
        )


def _compute_factor(server: str, factor: float, per_lbs: Mapping[int, float]) -> str:
    """``fast compute x0.94 (at LBS 64 x1.01, 256 x0.73)``: the server's factor, and where it has a per-LBS
    correction, its factor at those LBS."""
    text = f"{server} compute x{factor:.2f}"
    if per_lbs:
        text += " (at LBS " + ", ".join(f"{b} x{factor * f:.2f}" for b, f in sorted(per_lbs.items())) + ")"
    return text


def job_run_folder(loaded: LoadedConfig) -> Path:
    """``[storage] run_dir / <job name>`` (as :func:`jabascli.engine.layout.run_folder`)."""
    return loaded.config.storage.run_dir / loaded.config.job.name


def _candidate_folders(loaded: LoadedConfig) -> list[Path]:
    """The run folder, then the folders ``--fresh`` moved aside (``<name>.<YYYYmmdd-HHMMSS>[-N]``), newest first."""
    folder = job_run_folder(loaded)
    aside: list[tuple[str, int, Path]] = []
    if folder.parent.is_dir():
        pattern = re.compile(re.escape(folder.name) + r"\.(\d{8}-\d{6})(?:-(\d+))?$")
        for p in folder.parent.iterdir():
            m = pattern.match(p.name)
            if m and p.is_dir():
                aside.append((m.group(1), int(m.group(2) or 1), p))
    return [folder, *(p for _, _, p in sorted(aside, reverse=True))]


def refit_in_use(loaded: LoadedConfig, measured: ProfileSet) -> InUse | None:
    """The job's newest refit made on ``measured`` (the profiles as measured), or None."""
    digest = None
    for folder in _candidate_folders(loaded):
        for _, path in reversed(refit_generations(folder)):
            try:
                record = read_refit(path)
            except InputError:
                continue  # a damaged refit is passed over: the profiles alone still plan
            digest = digest or fingerprint(measured)
            if record.prior == digest:
                return InUse(record, path)
    return None


def measured_error(loaded: LoadedConfig) -> float | None:
    """The job's model's measured error (None: no refit, or its last run has no prediction): the larger of

    - how far the job's last run was from what the model that planned it predicted, ``|measured / predicted - 1|``
      (the model's error on a plan it had not seen), and
    - the refit's largest miss on the undisturbed runs it was fit to, ``|measured / refit's prediction - 1|``: a
      model that cannot explain a plan it has seen within ``e`` cannot rank two plans ``e`` apart (with one factor
      per server, a server faster beside another than alone is such a miss).
    """
    measured = measured_profiles(loaded)
    in_use = refit_in_use(loaded, measured)
    last = in_use.record.observations[-1] if in_use is not None and in_use.record.observations else None
    if in_use is None or last is None or not last.predicted_s:
        return None
    seen = observations(loaded, measured, [o for o in in_use.record.observations if not o.disturbed])
    misses = [abs(e) for e in errors(in_use.refit.apply(measured), seen)]
    return max([abs(last.measured_s / last.predicted_s - 1.0), *misses])


def measured_profiles(loaded: LoadedConfig) -> ProfileSet:
    """The job's profiles as measured (no refit)."""
    dirs = loaded.profile_dirs()
    return load_profile_set(dirs.memory, dirs.computation, dirs.communication, dirs.bucket)


def job_refit(loaded: LoadedConfig) -> InUse | None:
    """The refit the job's model starts from (:func:`refit_in_use` on its measured profiles), or None."""
    return refit_in_use(loaded, measured_profiles(loaded))


def host_disturbed(load: float | None, trainers: int, cpus: int) -> bool:
    """Whether other processes loaded the host: a load average above the job's trainers by half its cores."""
    return load is not None and load - trainers > cpus / 2


def _groups(loaded: LoadedConfig, profiles: ProfileSet, plan: ObservedPlan) -> tuple[GroupConfig, ...] | None:
    try:
        names = list(dict.fromkeys(a.server for a in plan.assignments))  # a server's GPUs may form several groups
        specs = {s.name: s for s in server_specs(loaded.config, profiles, names)}
    except InputError:
        return None  # a server the config no longer has, or one without profiles
    return tuple(GroupConfig(specs[a.server], a.gpus, a.vsw, a.ga, a.lbs) for a in plan.assignments)


def observations(loaded: LoadedConfig, profiles: ProfileSet, plans: list[ObservedPlan]) -> list[Observation]:
    """The plans the model can predict on ``profiles``, as observations (others, e.g. at an LBS outside the
    profiled range, say nothing about its terms; an uneven plan's groups carry their own LBS)."""
    out = []
    for p in plans:
        groups = _groups(loaded, profiles, p)
        if groups is None or p.weight_sync not in ("sequential", "overlap"):
            continue
        busy = tuple(a.busy_s for a in p.assignments)
        o = Observation(p.lbs, p.weight_sync, groups, p.measured_s, p.iterations, p.disturbed, busy)  # type: ignore[arg-type]
        try:
            predict(profiles, o)
        except (InputError, ValueError):
            continue
        out.append(o)
    return out


@dataclass(frozen=True)
class Learned:
    record: RefitRecord
    path: Path
    predicted_after_s: float
    """The refit model's prediction of the run's plan."""


def learn_from_run(
    loaded: LoadedConfig,
    plan: Plan,
    measured_s: float,
    iterations: int,
    *,
    load: float | None = None,
    cpus: int = 1,
    busy: Mapping[int, float] | None = None,
    prior_iterations: float = PRIOR_ITERATIONS,
) -> Learned:
    """Add a run's measured plan to the job's observations, refit from the measured profiles, write a generation.

    ``busy``: each rank's median busy time (``busy.csv``); the plan's ranks are its assignments' GPUs in order
    (:func:`jabascli.engine.plan.plan_from_solver`)."""
    this = ObservedPlan(
        lbs=plan.lbs,
        weight_sync=plan.weight_sync,
        assignments=observed_assignments(plan, busy or {}),
        measured_s=measured_s,
        iterations=iterations,
        disturbed=host_disturbed(load, plan.gpus, cpus),
        load=load,
        predicted_s=plan.iteration_time_s,
        time=round(time.time(), 3),
    )
    return learn(loaded, this, prior_iterations)


def observed_assignments(plan: Plan, busy: Mapping[int, float]) -> list[ObservedAssignment]:
    """The plan's assignments, each with the mean of its ranks' busy times where every one of them was measured."""
    out, rank = [], 0
    for a in plan.assignments:
        times = [busy.get(r) for r in range(rank, rank + a.gpus)]
        rank += a.gpus
        mean = statistics.fmean(times) if all(t is not None and t > 0 for t in times) else None  # type: ignore[arg-type]
        out.append(ObservedAssignment(server=a.server, gpus=a.gpus, vsw=a.vsw, ga=a.ga, lbs=a.lbs, busy_s=mean))
    return out


def learn(loaded: LoadedConfig, this: ObservedPlan, prior_iterations: float = PRIOR_ITERATIONS) -> Learned:
    """Add ``this`` (a plan as it trained, with what the model that chose it predicted) to the job's observations,
    refit from the measured profiles and write the next generation in the job's run folder."""
    measured = measured_profiles(loaded)
    in_use = refit_in_use(loaded, measured)
    history = [*(in_use.record.observations if in_use is not None else []), this]
    refit = fit(measured, observations(loaded, measured, history), prior_iterations)
    latest = observations(loaded, measured, [this])
    after = predict(refit.apply(measured), latest[0]) if latest else this.predicted_s or this.measured_s
    before = this.predicted_s
    folder = job_run_folder(loaded)
    generations = refit_generations(folder)
    record = RefitRecord(
        generation=(generations[-1][0] + 1) if generations else 1,
        prior=fingerprint(measured),
        prior_iterations=prior_iterations,
        compute=refit.compute,
        comm=refit.comm,
        lbs=refit.lbs,
        observations=history,
        error_before=(this.measured_s - before) / before if before else None,
        error_after=(this.measured_s - after) / after,
        time=this.time,
    )
    return Learned(record, write_refit(folder, record), after)
