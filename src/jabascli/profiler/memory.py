"""Memory profiler: the largest VSW count that fits on this node's device, per LBS.

For each LBS (``dynamic``: from the given one, growing by ``lbs_step`` until
even one VSW does not fit or ``max_lbs`` is passed (default: 16 x the first
LBS, or the largest GBS if smaller); ``static``: the given one only) the
largest VSW count that fits is found by doubling (1, 2, 4 ...) until
a count fails, then bisecting between the last count that fitted and the
first that did not. Memory grows with the VSW count and with the LBS, so the
search at one LBS never goes above the maximum found at the LBS before it,
nor above ``max_vsw``. At most ``2 * floor(log2(max)) + 2`` trials are run per
LBS whose maximum is ``max`` >= 1, and one when not even 1 VSW fits.

Each trial runs a few training iterations of :class:`~jabascli.profiler.step.VswStep`
in a process of its own (:mod:`jabascli.profiler.trial`), so that a failed
trial cannot poison the next. A trial that crashes for any reason other than
running out of memory stops the profiler with a :class:`RuntimeFailure`.

Writes ``<out>/<LBS>/<server>/max_memory_profile_info.json`` (seed keys plus
``trials``: the VSW count, peak bytes and outcome of every trial) for every
LBS at which at least one VSW fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jabascli.config.loader import LoadedConfig
from jabascli.errors import InputError, RuntimeFailure
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
from jabascli.profiles.formats import MemoryProfile, MemoryTrial, memory_profile_path, read_memory_profile
from jabascli.profiles.formats import write_memory_profile as _write

SearchMode = Literal["dynamic", "static"]
TRIAL_MODULE = "jabascli.profiler.trial"


@dataclass
class LbsResult:
    """What is known at one LBS: measured now, or read back from an earlier run."""

    lbs: int
    max_num_models: int
    trials: list[MemoryTrial] = field(default_factory=list)
    path: Path | None = None
    skipped: bool = False


@dataclass
class MemoryRun:
    target: Target
    folder: Path
    results: list[LbsResult]
    stopped: str
    """Why the LBS sweep ended, for people."""


def trial_bound(max_num_models: int) -> int:
    """Most trials the search may run at an LBS whose maximum is ``max_num_models``."""
    if max_num_models <= 0:
        return 1
    return 2 * math.floor(math.log2(max_num_models)) + 2


def search_max_vsw(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``n`` in ``0..cap`` with ``fits(n)``, for ``fits`` true up to some n and false after.

    Doubling from 1 (the last step clipped to ``cap``), then bisection.
    """
    if cap < 1:
        return 0
    good, n = 0, 1
    while True:
        n = min(n, cap)
        if not fits(n):
            bad = n
            break
        good = n
        if n == cap:
            return n
        n *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def lbs_sequence(start: int, search: SearchMode, step: int, max_lbs: int) -> Iterator[int]:
    if search == "static":
        yield start
        return
    lbs = start
    while lbs <= max_lbs:
        yield lbs
        lbs += step


def profile_memory(
    loaded: LoadedConfig,
    *,
    server: str | None = None,
    out: Path | None = None,
    lbs: int = 32,
    search: str = "dynamic",
    lbs_step: int | None = None,
    max_lbs: int | None = None,
    max_vsw: int = 64,
    iterations: int = 3,
    threads: int | None = None,
    force: bool = False,
    trial_timeout: float | None = 1800.0,
    reporter: Reporter | None = None,
    gbs_max: int | None = None,
    lbs_values: list[int] | None = None,
) -> MemoryRun:
    """Run the memory search on this node and write one profile per LBS that fits.

    ``lbs_values``: the LBS values to search, in increasing order, instead of
    the sweep from ``lbs`` (``jabas profile all``'s plan, :mod:`.lbsplan`).

    ``gbs_max``: the largest GBS the job may train. A device never runs more
    VSWs than the job has workers, ``GBS / LBS``, so no count above
    ``gbs_max // LBS`` is tried: it could never be chosen (the profile then
    says ``vsw_bound``, and more may fit).
    """
    reporter = reporter or Reporter()
    if search not in ("dynamic", "static"):
        raise InputError.at(None, "--search", f"expected 'dynamic' or 'static', got {search!r}")
    positive(lbs, "--lbs")
    positive(max_vsw, "--max-vsw")
    positive(iterations, "--trial-iters")
    step = lbs_step if lbs_step is not None else lbs
    positive(step, "--lbs-step")
    if max_lbs is None:
        # No LBS above the largest GBS can be used, and 16 steps bound the sweep's length.
        largest = loaded.config.batching.gbs_max
        max_lbs = max(lbs, min(largest, 16 * lbs)) if largest else 16 * lbs
    if max_lbs < lbs:
        raise InputError.at(None, "--max-lbs", f"{max_lbs} is below --lbs {lbs}")
    target = resolve_target(loaded, server, threads)
    _, workload_spec = job_workload(loaded)  # loaded here too, so that a bad workload is bad input
    folder = ensure_writable(Path(out) if out is not None else loaded.profile_dirs().memory)
    name = target.server.name

    sequence = list(lbs_sequence(lbs, search, step, max_lbs))  # type: ignore[arg-type]
    stopped = "static search: only --lbs" if search == "static" else f"reached --max-lbs {max_lbs}"
    if lbs_values is not None:
        sequence, stopped = sorted(lbs_values), f"measured the planned LBS {', '.join(map(str, sorted(lbs_values)))}"
    results: list[LbsResult] = []
    cap = max_vsw
    for index, batch in enumerate(sequence):

        def step_of(done: int, bound: int, n: int, index: int = index, batch: int = batch) -> None:
            reporter.progress(index + done / bound, len(sequence), f"LBS {batch}: trying {n} VSWs")

        path = memory_profile_path(folder, batch, name)
        if path.is_file() and not force:
            known = read_memory_profile(path)
            _check_same_device(path, known, target)
            check_reusable(path, known.precision, workload_spec["precision"])
            results.append(LbsResult(batch, known.max_num_models, list(known.trials or []), path, skipped=True))
            n = known.max_num_models
            reporter.note(f"LBS {batch}: at most {n} VSW{'s' if n != 1 else ''} fit (already profiled, {path})")
        else:
            bound = cap if gbs_max is None else min(cap, max(1, gbs_max // batch))
            bounded = bound < cap
            results.append(
                _search_lbs(target, workload_spec, folder, batch, bound, iterations, trial_timeout, step_of, bounded)
            )
            reporter.note(_describe(results[-1], target))
            if bound < cap and results[-1].max_num_models == bound:
                reporter.note(
                    f"LBS {batch}: more than {bound} VSW{'s' if bound != 1 else ''} not tried: "
                    f"{bound} x LBS {batch} already reaches GBS {gbs_max}, the most the job trains"
                )
        reporter.progress(index + 1, len(sequence), f"LBS {batch}: done")
        cap = min(cap, results[-1].max_num_models)
        if cap < 1:
            stopped = f"not even 1 VSW fits at LBS {batch}"
            break
    return MemoryRun(target, folder, results, stopped)


def _search_lbs(
    target: Target,
    workload_spec: dict[str, Any],
    folder: Path,
    lbs: int,
    cap: int,
    iterations: int,
    timeout: float | None,
    on_trial: Callable[[int, int, int], None],
    bounded: bool = False,
) -> LbsResult:
    """Search one LBS; write its profile when at least one VSW fits."""
    trials: list[MemoryTrial] = []
    bound = trial_bound(cap)

    def fits(n: int) -> bool:
        on_trial(len(trials), bound, n)
        trials.append(_run_trial(target, workload_spec, lbs, n, iterations, timeout))
        return trials[-1].fits

    best = search_max_vsw(fits, cap)
    written = None
    if best >= 1:
        profile = MemoryProfile(
            gpu_type=target.device_type,
            total_memory=target.memory_bytes,
            lbs=lbs,
            max_num_models=best,
            trials=trials,
            vsw_bound=cap if bounded and best == cap else None,
            **measured_with(workload_spec["precision"], target.threads, target.kind),
        )
        written = _write(folder, target.server.name, profile)
    return LbsResult(lbs, best, trials, written)


def _check_same_device(path: Path, known: MemoryProfile, target: Target) -> None:
    if known.gpu_type != target.device_type or known.total_memory != target.memory_bytes:
        raise InputError.at(
            path,
            None,
            f"was measured on {known.gpu_type!r} with {known.total_memory:,} bytes, but this run profiles "
            f"{target.device_type!r} with {target.memory_bytes:,} bytes: measure again with --force, "
            "or write to another --out",
        )


def _run_trial(
    target: Target, workload_spec: dict[str, Any], lbs: int, n: int, iterations: int, timeout: float | None
) -> MemoryTrial:
    spec = {
        "kind": "memory",
        **workload_spec,
        "lbs": lbs,
        "num_models": n,
        "device": target.device,
        "budget": target.memory_bytes,
        "threads": target.threads,
        "iterations": iterations,
    }
    where = f"memory trial at LBS {lbs} with {n} VSWs"
    try:
        result = run_child(TRIAL_MODULE, spec, timeout=timeout, fresh=target.kind == "cuda")
    except ChildCrashed as crash:
        raise RuntimeFailure([f"{where} crashed (not counted as out of memory): {crash.describe()}"]) from None
    peak = result.get("peak_bytes")
    if result.get("status") == "oom":
        return MemoryTrial(num_models=n, peak_bytes=peak, fits=False, error=result.get("error"))
    fits = peak is None or peak <= target.memory_bytes
    error = None if fits else f"peak {peak:,} bytes exceeds the budget of {target.memory_bytes:,} bytes"
    return MemoryTrial(num_models=n, peak_bytes=peak, fits=fits, error=error)


def _describe(result: LbsResult, target: Target) -> str:
    lbs, best, trials = result.lbs, result.max_num_models, result.trials
    count = f"{len(trials)} trial{'s' if len(trials) != 1 else ''}"
    if best == 0:
        return f"LBS {lbs}: not even 1 VSW fits in {_mib(target.memory_bytes)} ({count})"
    peak = next((t.peak_bytes for t in trials if t.num_models == best and t.fits), None)
    at = f", peak {_mib(peak)} of {_mib(target.memory_bytes)}" if peak is not None else ""
    return f"LBS {lbs}: at most {best} VSW{'s' if best != 1 else ''} fit ({count}{at})"


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**20:,.1f} MiB"
