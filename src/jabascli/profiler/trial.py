"""One memory trial or one computation run, in a process of its own.

``python -m jabascli.profiler.trial SPEC RESULT`` (see :mod:`jabascli.profiler.child`).
The spec names the workload, the LBS, the VSW count, the device and what to
measure; the result says how it went:

``status``
    ``ok``; ``oom`` when the device ran out of memory (a CUDA
    ``OutOfMemoryError``, or an emulated device's tensors exceeding its
    budget); ``error`` for anything else, with the error's first line (the
    child then exits 1, :mod:`jabascli.profiler.worker`). Only
    ``oom`` means "does not fit": a trial that crashed for another reason is
    never counted as out of memory.
``peak_bytes``
    memory trials: ``torch.cuda.max_memory_allocated`` on CUDA, the peak of
    live tensor bytes (:mod:`jabascli.memtrack`) elsewhere.
``phases``, ``total``
    computation runs: per-phase median and quartiles in ms.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from jabascli.profiler.child import emit_progress
from jabascli.profiler.worker import first_line, worker_main

MIN_WARMUP = 2
"""Warm-up iterations a time budget never cuts: the first iteration pays one-time costs."""
MIN_TIMED_ITERS = 5
"""Measured iterations a time budget never cuts: enough for a median and quartiles."""


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating between order statistics."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "p25": percentile(values, 25), "p75": percentile(values, 75)}


def median_is_stable(values: list[float], tolerance: float) -> bool:
    """Whether the medians of the first and the second half agree within ``tolerance`` (relative)."""
    if len(values) < 4:
        return False
    half = len(values) // 2
    whole = median(values)
    return abs(median(values[:half]) - median(values[half:])) <= tolerance * max(whole, 1e-9)


def _setup(spec: dict[str, Any]) -> Any:
    import torch

    from jabascli.engine.host_memory import keep_freed_memory

    keep_freed_memory()  # as the trainer does: a profile describes the trainer that will run

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec["device"] == "cuda":
        torch.cuda.set_device(0)
        budget = spec.get("budget")
        total = torch.cuda.get_device_properties(0).total_memory
        if budget and budget < total:
            # A server that says its GPUs have less memory than this one is held to its figure.
            torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    from jabascli.workload import load_workload

    data = Path(spec["data"]) if spec.get("data") else None
    return load_workload(spec["workload"], spec.get("options") or {}, data)


def _is_cuda_oom(exc: BaseException) -> bool:
    """A CUDA allocation failure: the OOM error itself, or cuBLAS/cuDNN failing to get workspace."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.cuda.OutOfMemoryError) or any(
        marker in text for marker in ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
    )


def run_memory_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """A few training iterations of ``num_models`` VSWs; did they fit, and at what peak."""
    import torch

    from jabascli.memtrack import TensorMemoryTracker
    from jabascli.profiler.step import VswStep, synthetic_batches

    workload = _setup(spec)
    lbs, n, iterations = int(spec["lbs"]), int(spec["num_models"]), int(spec.get("iterations", 3))
    precision = spec.get("precision", "fp32")
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats(0)
        try:
            step = VswStep(workload, lbs, n, "cuda", synthetic_batches(workload, lbs), precision=precision)
            for _ in range(iterations):
                step.run()
            torch.cuda.synchronize()
        except Exception as exc:
            if not _is_cuda_oom(exc):
                raise
            return {"status": "oom", "peak_bytes": int(torch.cuda.max_memory_allocated(0)), "error": first_line(exc)}
        return {"status": "ok", "peak_bytes": int(torch.cuda.max_memory_allocated(0))}

    tracker = TensorMemoryTracker(budget=spec.get("budget"))
    try:
        with tracker:
            step = VswStep(workload, lbs, n, "cpu", synthetic_batches(workload, lbs), precision=precision)
            for _ in range(iterations):
                step.run()
    except Exception:
        # However the error surfaced (autograd may wrap it), the tracker knows whether it raised it.
        if tracker.exceeded is None:
            raise
        return {"status": "oom", "peak_bytes": tracker.peak, "error": str(tracker.exceeded)}
    return {"status": "ok", "peak_bytes": tracker.peak}


def run_comp(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, then measured iterations until the median is stable; per-phase statistics.

    The iteration is the engine's own (:class:`~jabascli.profiler.step.EngineStep`),
    one rank in a one-process group, with ``sequential`` weight sync. With
    ``spec["overlap"]``, as many iterations again with ``overlap``: their median
    total, less the sequential one without its optimizer step, is what the
    per-bucket optimizer steps add to an iteration (``overlap_update``).
    """
    import torch

    from jabascli.engine.distributed import DistEnv, init_process_group
    from jabascli.engine.weight_sync import supports_overlap
    from jabascli.profiler.step import PHASES, EngineStep

    workload = _setup(spec)
    lbs, n = int(spec["lbs"]), int(spec["num_models"])
    warmup, min_iters = int(spec["warmup"]), int(spec["min_iters"])
    max_iters = max(min_iters, int(spec.get("max_iters", min_iters)))
    tolerance = float(spec.get("tolerance", 0.05))
    # A time budget (``jabas profile all``): slow points stop after MIN_TIMED_ITERS once it is spent.
    max_seconds = spec.get("max_seconds")
    budget = math.inf if max_seconds is None else float(max_seconds)
    slowdown = float(spec.get("slowdown", 1.0))
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    init_process_group(DistEnv(0, 1, 0, None, None), device)  # DDP needs a group: this process alone
    step: EngineStep | None = None
    overlap_update: float | None = None

    def engine_step(weight_sync: str) -> EngineStep:
        return EngineStep(
            workload,
            lbs,
            n,
            device,
            vsw_strategy=spec.get("vsw_strategy", "auto"),
            weight_sync=weight_sync,
            synthetic=bool(spec.get("synthetic_data")),
            slowdown=slowdown,
            precision=spec.get("precision", "fp32"),
            clip_grad_norm=spec.get("clip_grad_norm"),
        )

    try:
        step = engine_step("sequential")
        planned = warmup + min_iters
        began = time.perf_counter()
        for i in range(warmup):
            step.run()
            emit_progress(done=i + 1, total=planned)
            if i + 1 >= MIN_WARMUP and time.perf_counter() - began >= budget / 2:
                break
        began = time.perf_counter()
        samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
        totals: list[float] = []
        without_update: list[float] = []  # for the overlap comparison
        while True:
            times = step.run()
            for phase in PHASES:
                samples[phase].append(getattr(times, phase))
            totals.append(times.total)
            without_update.append(times.total - times.update)
            count = len(totals)
            emit_progress(done=warmup + count, total=max(planned, warmup + count + 1))
            if count >= max_iters or (count >= min_iters and median_is_stable(totals, tolerance)):
                break
            if count >= MIN_TIMED_ITERS and time.perf_counter() - began >= budget:
                break
        last_loss, strategy = step.last_loss, step.vsw_strategy
        if spec.get("overlap") and supports_overlap(step.trainer.optimizer):
            step = None  # one trainer at a time: the memory profile vouches for one
            step = engine_step("overlap")
            for _ in range(min(warmup, MIN_WARMUP) if max_seconds is not None else warmup):
                step.run()
            overlapped = [step.run().total for _ in range(count)]
            overlap_update = max(0.0, median(overlapped) - median(without_update))
    except Exception as exc:
        if spec["device"] == "cuda" and _is_cuda_oom(exc):
            return {"status": "oom", "error": first_line(exc)}
        raise
    finally:
        step = None  # free DDP before its process group goes
        _leave_group()
    if not math.isfinite(last_loss):
        return {"status": "error", "error": f"the loss is not finite ({last_loss}): check the workload's loss"}
    return {
        "status": "ok",
        "vsw_strategy": strategy,
        "phases": {phase: summarize(values) for phase, values in samples.items()},
        "total": summarize(totals),
        "overlap_update": overlap_update,
        "iterations": len(totals),
        "warmup": warmup,
        "stable": median_is_stable(totals, tolerance),
        "timer": "cuda-events" if spec["device"] == "cuda" else "perf_counter",
    }


def _leave_group() -> None:
    """Leave the process group, once DDP is freed (left to the interpreter's exit, gloo may abort)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    return run_memory_trial(spec) if spec["kind"] == "memory" else run_comp(spec)


def main(argv: list[str] | None = None) -> int:
    return worker_main(sys.argv[1:] if argv is None else argv, _measure)


if __name__ == "__main__":
    sys.exit(main())
