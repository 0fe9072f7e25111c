"""Computation profiler: time per phase of an iteration, per (LBS, VSW count).

For every LBS of this server's memory profile, and VSW counts 1, the maximum
that fits, and one between when the maximum is above 2, one run of
:class:`~jabascli.profiler.step.VswStep` in a process of its own
(:mod:`jabascli.profiler.trial`): warm-up iterations, then measured ones (at
least ``iters``, more, up to four times as many, until the medians of the
first and second half of the total time agree within 5%). Times are taken
with CUDA events on a GPU and ``time.perf_counter`` on the CPU.

Each phase's value is its median over the measured iterations, and
``total_time`` their sum, as in the seed. New fields: the quartiles of every
phase and of the per-iteration total (``spread``), the iteration counts, the
timer, and the ``slowdown`` of an emulated server, whose trainer is measured
as the engine runs it: sleeping ``slowdown - 1`` times each forward and
backward.

Writes ``<out>/<LBS>/<server>/<server>_<model>_<LBS>_<VSW>_comp_profile.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from jabascli.config.loader import LoadedConfig
from jabascli.errors import InputError, RuntimeFailure
from jabascli.perfmodel.compute import vsw_pays
from jabascli.profiler.child import ChildCrashed, run_child
from jabascli.profiler.common import (
    Reporter,
    Target,
    check_reusable,
    ensure_writable,
    job_workload,
    measured_with,
    positive,
    resolve_target,
)
from jabascli.profiles.formats import (
    CompProfile,
    comp_profile_path,
    read_comp_profile,
    read_memory_profiles,
    write_comp_profile,
)

TRIAL_MODULE = "jabascli.profiler.trial"
PHASE_KEYS = {
    "data": "data_time",
    "fwd": "fwd_time",
    "bwd": "bwd_time",
    "update": "update_time",
    "copy": "copy_time",
    "overhead": "overhead_time",
}
GPU_COOLDOWN = 10.0  # seconds between runs on a GPU, so each starts at a similar temperature and clock


@dataclass(frozen=True)
class PointBudget:
    """How much ``jabas profile all`` spends per computation point (defaults: the single profiler's)."""

    seconds: float | None = None
    """Stop measuring a point after this many seconds of iterations (at least ``MIN_TIMED_ITERS``)."""
    overlap_once: bool = False
    """Measure ``overlap`` weight sync at one point per device: its cost is the device's, not the LBS's."""
    stop_vsw: bool = False
    """Stop the VSW sweep at the first count that does not pay (:func:`vsw_pays`), and measure only one
    VSW at larger LBS values once a sweep has shown that VSWs do not pay on the device."""
    repeats: int = 1
    """On a CPU, measure a point whose iteration per VSW is shorter than ``repeat_below_ms`` in this many
    processes and keep the run of median total. At a few milliseconds per iteration each process's speed
    is a draw: one point measured in eight processes started seconds apart ranged 3.7-4.5 ms, which is
    more than the 5% by which VSWs must pay and more than the gains the solver weighs; every point is
    cheap there. The threshold is per VSW so that a VSW point is measured in as many processes as the
    single-VSW point at its LBS: whether VSWs pay is the ratio of the two, and a single draw against a
    median of three made VSW 5 "pay" on a CPU, where VSWs run one after another. On an emulated device
    it applies to the CPU's own work, before the slowdown: the sleeps scale a draw by the same factor,
    and one such point (tiny ViT, 3x, LBS 16) measured 97.5 ms where 75.7 ms was its usual."""
    repeat_below_ms: float = 0.0

    def runs(self, first: CompProfile, on_gpu: bool) -> int:
        """How many processes measure the point whose first process measured ``first``."""
        if on_gpu:  # a GPU measures each point once, after a cooldown (GPU_COOLDOWN)
            return 1
        work_ms = first.total_time / first.num_models / (first.slowdown or 1.0)
        return max(self.repeats, 1) if work_ms < self.repeat_below_ms else 1


@dataclass
class CompResult:
    lbs: int
    num_models: int
    profile: CompProfile
    path: Path
    skipped: bool = False


@dataclass
class CompRun:
    target: Target
    folder: Path
    model: str
    results: list[CompResult]


def vsw_points(max_num_models: int) -> list[int]:
    """VSW counts to measure: 1, the maximum, and the middle when the maximum is above 2."""
    if max_num_models < 1:
        return []
    points = {1, max_num_models}
    if max_num_models > 2:
        points.add((max_num_models + 1) // 2)
    return sorted(points)


def profile_comp(
    loaded: LoadedConfig,
    *,
    server: str | None = None,
    out: Path | None = None,
    memory_dir: Path | None = None,
    warmup: int = 5,
    iters: int = 20,
    cooldown: float | None = None,
    threads: int | None = None,
    synthetic_data: bool = False,
    force: bool = False,
    run_timeout: float | None = 3600.0,
    reporter: Reporter | None = None,
    budget: PointBudget | None = None,
) -> CompRun:
    """Measure every (LBS, VSW count) the memory profile allows; write one file each.

    ``budget`` (``jabas profile all``'s) bounds each point's time, measures
    ``overlap`` once per device and stops the VSW sweep where VSWs stop paying.
    """
    reporter = reporter or Reporter()
    budget = budget or PointBudget()
    if warmup < 0:
        raise InputError.at(None, "--warmup", f"must be 0 or more, got {warmup}")
    positive(iters, "--iters")
    if cooldown is not None and cooldown < 0:
        raise InputError.at(None, "--cooldown", f"must be 0 or more, got {cooldown}")
    target = resolve_target(loaded, server, threads)
    workload, workload_spec = job_workload(loaded)
    if cooldown is None:
        cooldown = GPU_COOLDOWN if target.kind == "cuda" else 0.0
    memory_folder = Path(memory_dir) if memory_dir is not None else loaded.profile_dirs().memory
    plan = _plan(memory_folder, target)
    folder = ensure_writable(Path(out) if out is not None else loaded.profile_dirs().computation)
    name, model = target.server.name, workload.name

    results: list[CompResult] = []
    measured_before = False
    overlap_known = False
    pays: bool | None = None  # whether VSWs pay on this device, once a sweep has told
    total = len(plan)
    index = 0
    for lbs, counts in _by_lbs(plan):
        here: list[CompProfile] = []
        for n in counts:
            swept = any(p.num_models > 1 for p in here)
            if n > 1 and budget.stop_vsw and (pays is False or (swept and not vsw_pays(here))):
                total -= 1
                reporter.note(f"LBS {lbs}, {n} VSWs: not measured, VSWs do not pay on {name} (GA does the same)")
                continue
            path = comp_profile_path(folder, lbs, name, model, n)
            what = f"LBS {lbs}, {n} VSW{'s' if n != 1 else ''}"
            if path.is_file() and not force:
                known = read_comp_profile(path)
                check_reusable(path, known.precision, workload_spec["precision"])
                results.append(CompResult(lbs, n, known, path, skipped=True))
                here.append(known)
                overlap_known = overlap_known or known.overlap_update_time is not None
                reporter.note(f"{what}: already profiled ({path})")
                index += 1
                reporter.progress(index, total, f"{what}: already profiled")
                continue
            if measured_before and cooldown > 0:
                reporter.progress(index, total, f"cooling down for {cooldown:g} s")
                time.sleep(cooldown)
            measured_before = True

            def on_progress(fields: dict[str, Any], index: int = index, what: str = what, total: int = total) -> None:
                fraction = min(fields.get("done", 0) / max(fields.get("total", 1), 1), 1.0)
                reporter.progress(index + fraction, total, f"{what}: iteration {fields.get('done')}")

            reporter.progress(index, total, f"{what}: starting")
            spec = {
                "kind": "comp",
                **workload_spec,
                "lbs": lbs,
                "num_models": n,
                "device": target.device,
                "threads": target.threads,
                "warmup": warmup,
                "min_iters": iters,
                "max_iters": 4 * iters,
                "max_seconds": budget.seconds,
                "slowdown": target.slowdown,
                "synthetic_data": synthetic_data,
                "vsw_strategy": loaded.config.job.vsw_strategy,
                # Also measure overlap weight sync, if the workload's optimizer allows it: a device's
                # cost, so once per device is enough when the budget says so.
                "overlap": not (budget.overlap_once and overlap_known),
            }
            to_profile = partial(
                _profile, model=model, target=target, lbs=lbs, n=n, precision=workload_spec["precision"]
            )
            runs_for = partial(budget.runs, on_gpu=target.kind == "cuda")
            result, profile = _measure_point(spec, on_progress, run_timeout, what, runs_for, to_profile)
            written = write_comp_profile(folder, name, profile)
            results.append(CompResult(lbs, n, profile, written))
            here.append(profile)
            overlap_known = overlap_known or profile.overlap_update_time is not None
            unstable = "" if result["stable"] else ", median still moving by more than 5%"
            runs = f", the median of {len(profile.run_totals)} processes" if profile.run_totals else ""
            reporter.note(
                f"{what}: {profile.total_time:.2f} ms per iteration ({result['iterations']} measured{unstable}{runs})"
            )
            index += 1
            reporter.progress(index, total, f"{what}: done")
        if pays is None and any(p.num_models > 1 for p in here):
            pays = vsw_pays(here)
    return CompRun(target, folder, model, results)


def _by_lbs(plan: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    grouped: dict[int, list[int]] = {}
    for lbs, n in plan:
        grouped.setdefault(lbs, []).append(n)
    return sorted(grouped.items())


def _plan(memory_folder: Path, target: Target) -> list[tuple[int, int]]:
    """(LBS, VSW count) pairs to measure, from this server's memory profiles."""
    name = target.server.name
    if not memory_folder.is_dir():
        raise InputError.at(memory_folder, None, "memory profile folder does not exist: run `jabas profile mem` first")
    profiles = read_memory_profiles(memory_folder)
    mine = {lbs: p for (server, lbs), p in profiles.items() if server == name}
    if not mine:
        found = sorted({server for server, _ in profiles})
        others = f" (it has profiles for {', '.join(found)})" if found else ""
        raise InputError.at(
            memory_folder,
            None,
            f"no memory profile for server {name!r}{others}: run `jabas profile mem --server {name}` first",
        )
    for lbs, profile in sorted(mine.items()):
        if profile.gpu_type != target.device_type:
            raise InputError.at(
                memory_folder / str(lbs) / name,
                "gpu_type",
                f"{profile.gpu_type!r} was profiled, but server {name!r} is a {target.device_type!r}",
            )
    return [(lbs, n) for lbs, profile in sorted(mine.items()) for n in vsw_points(profile.max_num_models)]


def _measure_point(
    spec: dict[str, Any],
    on_progress: Any,
    timeout: float | None,
    what: str,
    runs_for: Callable[[CompProfile], int],
    to_profile: Callable[[dict[str, Any]], CompProfile],
) -> tuple[dict[str, Any], CompProfile]:
    """One point's run and profile; a short point (see :attr:`PointBudget.repeats`) is measured in
    several processes, and the run of median ``total_time`` kept, with every run's total."""
    result = _run(spec, on_progress, timeout, what)
    profile = to_profile(result)
    repeats = runs_for(profile)
    if repeats <= 1:
        return result, profile
    runs = [(result, profile)]
    for _ in range(repeats - 1):
        again = _run(spec, on_progress, timeout, what)
        runs.append((again, to_profile(again)))
    result, profile = sorted(runs, key=lambda run: run[1].total_time)[len(runs) // 2]
    return result, profile.model_copy(update={"run_totals": [p.total_time for _, p in runs]})


def _run(spec: dict[str, Any], on_progress: Any, timeout: float | None, what: str) -> dict[str, Any]:
    try:
        result = run_child(TRIAL_MODULE, spec, on_progress, timeout=timeout)
    except ChildCrashed as crash:
        raise RuntimeFailure([f"computation run ({what}) crashed: {crash.describe()}"]) from None
    if result.get("status") == "oom":
        raise RuntimeFailure(
            [
                f"computation run ({what}) ran out of memory although the memory profile says it fits: "
                f"{result.get('error')}; measure memory again (`jabas profile mem --force`)"
            ]
        )
    if result.get("status") != "ok":
        raise RuntimeFailure([f"computation run ({what}) crashed: {result.get('error')}"])
    return result


def _profile(result: dict[str, Any], model: str, target: Target, lbs: int, n: int, precision: str) -> CompProfile:
    phases = result["phases"]
    times = {key: phases[phase]["median"] for phase, key in PHASE_KEYS.items()}
    spread = {key: [phases[phase]["p25"], phases[phase]["p75"]] for phase, key in PHASE_KEYS.items()}
    spread["total_time"] = [result["total"]["p25"], result["total"]["p75"]]
    return CompProfile(
        model=model,
        gpu_type=target.device_type,
        lbs=lbs,
        num_models=n,
        total_time=sum(times.values()),
        **times,
        bn_sync_time=0.0,
        spread=spread,
        iterations=result["iterations"],
        warmup=result["warmup"],
        timer=result["timer"],
        slowdown=target.slowdown,
        vsw_strategy=result.get("vsw_strategy"),
        **measured_with(precision, target.threads, target.kind),
        overlap_update_time=result.get("overlap_update"),
    )
