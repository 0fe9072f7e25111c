"""``jabas profile all``: every profile the solver needs, in one run.

On one machine whose config lists only servers on this host (loopback,
emulated or not), in this order:

1. the gradient buckets (:mod:`.bucket`), which also size the all-reduce
   messages worth measuring (from half the smallest bucket to twice all the
   gradients);
2. per server: memory (:mod:`.memory`), then computation (:mod:`.comp`), at
   the LBS values balanced splits need (:mod:`.lbsplan`: powers of two from
   the balanced LBS of ``GBS_min`` to ``GBS_max``, where ``GBS_max`` is
   ``--gbs-max``, else ``[batching] gbs_max``, else ``initial_gbs``, and
   ``GBS_min`` is ``--gbs-min``, else ``[batching] gbs_min``, else
   ``initial_gbs``; ``--lbs N`` sweeps N, 2N, 3N ... instead). The memory
   search never tries more VSWs than ``GBS_max // LBS`` (no device can run
   more VSWs than the job has workers); the computation profiler measures 1,
   the middle and the most VSWs allowed, with the thread count ``jabas run``
   gives that server's trainers here, within a time budget per point
   (:class:`~.comp.PointBudget`: at most ``POINT_SECONDS`` of iterations,
   ``overlap`` once per device, no more VSW counts once they stop paying).
   Where no LBS fits a server's memory, its computation is not measured: ok
   with ``hybrid`` (the planner splits the model), a failure otherwise;
3. the intra-node all-reduce (:mod:`.comm`, as many processes as the largest
   server has devices, at least 2);
4. with several servers, the inter-node all-reduce over loopback, one process
   per server, as ``jabas run``'s trainers of different servers reach each
   other;
5. with ``hybrid`` (``--hybrid``), or when the job has ``[parallel]``, the hybrid
   planner's profiles (:mod:`.hybrid`).

A server whose profile fails does not stop the others: the failure is kept
and named at the end. When servers are on other machines, :mod:`.remote`
profiles each on its node over SSH, one after another, then the all-reduce
between the nodes. With ``server`` given, only this node's server is profiled
(steps 1-3; what each node runs for :mod:`.remote`, and what a user may run by
hand), and :attr:`SuiteRun.commands` lists the ``jabas profile comm`` command
each node would run for the inter-node profile.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.devices import detect_devices
from jabascli.errors import InputError, JabasError, RuntimeFailure
from jabascli.profiler.common import Reporter, ShareReporter, pick_server, servers_here
from jabascli.profiler.lbsplan import device_speeds, lbs_plan
from jabascli.profiles.formats import comm_profile_path

INTER_PORT = 29510

# Rough seconds per stage, for the estimate said before starting and each stage's share of the
# progress bar: a child process's start (fork, workload import), a memory trial, the all-reduce stages.
# Calibrated on the tiny ResNet on 2 cores (30 memory trials in 28 s, 15 computation points in 68 s).
CHILD_S = 1.5
TRIAL_S = 1.0
# On CUDA no process is forked (CUDA does not survive a fork): every memory trial and
# computation point starts a process of its own, ~4 s of it torch's import and CUDA's start, and a
# point's warm-up (cuDNN's autotuning) takes longer. Calibrated on the tiny ResNet on an H100:
# memory trials 9.7-10 s each, computation points 13-27 s.
CUDA_CHILD_S = 15.0
CUDA_TRIAL_S = 10.0
FIXED_S = {"bucket": 4.0, "intra": 8.0, "inter": 8.0, "hybrid": 20.0}
POINT_SECONDS = 2.0
"""Seconds of measured iterations per computation point, at most (five iterations at least)."""
SHORT_POINT_MS = 50.0
SHORT_POINT_RUNS = 3
"""On a CPU, a point whose iteration per VSW (on an emulated device, before its slowdown) is shorter than
``SHORT_POINT_MS`` is measured in this many processes (:attr:`~.comp.PointBudget.repeats`)."""


@dataclass
class StageResult:
    name: str
    """``bucket``, ``mem fast``, ``comp fast``, ``intra``, ``inter``."""
    ok: bool
    detail: str
    seconds: float = 0.0
    """How long the stage took."""


@dataclass
class SuiteRun:
    stages: list[StageResult] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    """Commands to run on every node for the inter-node profile (a real cluster)."""
    gbs_max: int | None = None
    lbs_values: list[int] | None = None
    """The LBS values planned (None: the ``--lbs`` sweep)."""
    expected_s: float = 0.0
    """The time the run was expected to take, said before it started."""
    bucket_mib: list[float] = field(default_factory=list)
    """The gradient buckets (MB) measured or found on disk."""

    @property
    def failures(self) -> list[StageResult]:
        return [s for s in self.stages if not s.ok]


def gbs_bound(loaded: LoadedConfig, gbs_max: int | None) -> int | None:
    """The largest GBS the job trains: ``--gbs-max``, else ``[batching] gbs_max``, else ``initial_gbs``."""
    batching = loaded.config.batching
    return gbs_max or batching.gbs_max or batching.initial_gbs


def gbs_floor(loaded: LoadedConfig, gbs_min: int | None, bound: int) -> int:
    """The smallest GBS the job trains: ``--gbs-min``, else ``[batching] gbs_min``, else ``initial_gbs``."""
    batching = loaded.config.batching
    return min(gbs_min or batching.gbs_min or batching.initial_gbs or bound, bound)


def planned_lbs(
    loaded: LoadedConfig, servers: list[ServerConfig], gbs_min: int | None, bound: int | None
) -> list[int] | None:
    """The LBS values balanced splits of the job's GBS range need on ``servers``; None without a GBS bound."""
    if bound is None:
        return None
    everyone = loaded.config.available()  # the split is over the whole cluster, even when profiling one node
    return lbs_plan(gbs_floor(loaded, gbs_min, bound), bound, device_speeds(everyone or servers))


def expected_seconds(
    lbs_values: list[int], bound: int | None, servers: int, comm_s: float, cuda: bool = False
) -> dict[str, float]:
    """Expected seconds per stage kind: memory and computation per server, and the rest.

    Per LBS, the memory search's doubling up to ``GBS_max // LBS`` VSWs (at most 64) and one
    computation point (two more at the first LBS, for the VSW sweep), each point a child's start
    plus at most 1.5 x ``POINT_SECONDS`` (warm-up and measurement), ``overlap`` once. ``cuda``:
    the servers run on a GPU, where every trial and point is a process of its own.
    """
    child_s, trial_s = (CUDA_CHILD_S, CUDA_TRIAL_S) if cuda else (CHILD_S, TRIAL_S)
    caps = [min(64, bound // b) if bound else 64 for b in lbs_values]
    mem = sum(max(1, c).bit_length() for c in caps) * trial_s
    comp = (len(lbs_values) + 2) * (child_s + 1.5 * POINT_SECONDS) + POINT_SECONDS
    total = FIXED_S["bucket"] + servers * (mem + comp) + comm_s
    return {"bucket": FIXED_S["bucket"], "mem": mem, "comp": comp, "total": total}


def comm_sizes(bucket_mib: list[float]) -> str:
    """All-reduce sizes (MB) worth measuring: from half the smallest bucket to twice all the gradients."""
    positive = [b for b in bucket_mib if b > 0] or [1.0]
    lo = 2.0 ** math.floor(math.log2(min(positive) / 2))
    hi = max(2 * sum(positive), 4 * lo)
    return f"{lo:g}:{hi:.4g}"


def inter_commands(loaded: LoadedConfig, port: int = INTER_PORT) -> list[str]:
    """The command each server runs, at the same time, for the inter-node profile of a cluster."""
    servers = loaded.config.available()
    master = f"{servers[0].host}:{port}"
    return [
        f"jabas profile comm -c {loaded.path} --server {s.name} --nprocs {s.devices} "
        f"--rank {rank} --world {len(servers)} --master {master}"
        for rank, s in enumerate(servers)
    ]


def profile_all(
    loaded: LoadedConfig,
    *,
    server: str | None = None,
    lbs: int | None = None,
    gbs_max: int | None = None,
    gbs_min: int | None = None,
    iters: int = 20,
    sizes: str | None = None,
    force: bool = False,
    reporter: Reporter | None = None,
    hybrid: bool = False,
) -> SuiteRun:
    """Measure every profile the solver needs for ``loaded``'s job.

    ``lbs``: sweep N, 2N, 3N ... (the single memory profiler's way) instead of the balanced plan.
    Servers on other machines are :func:`.remote.profile_cluster`'s (``server`` not given).
    """
    from jabascli.profiler.bucket import profile_buckets
    from jabascli.profiler.comm import profile_comm
    from jabascli.profiler.comp import PointBudget, profile_comp
    from jabascli.profiler.memory import profile_memory

    reporter = reporter or Reporter()
    if not loaded.config.available():
        raise InputError.at(loaded.path, "cluster.servers", "no servers: add a [[cluster.servers]] entry per node")
    if server is not None:
        mine = [pick_server(loaded, server)]
        many = len(loaded.config.available()) > 1
    else:
        mine, elsewhere = servers_here(loaded)
        if elsewhere:
            names = ", ".join(f"{s.name} ({s.host})" for s in elsewhere)
            raise InputError.at(
                loaded.path,
                "cluster.servers",
                f"servers not on this machine: {names}: profile them with profile_cluster (profiler/remote.py)",
            )
        many = len(mine) > 1
    bound = gbs_bound(loaded, gbs_max)
    lbs_values = None if lbs is not None else planned_lbs(loaded, mine, gbs_min, bound)
    start = lbs if lbs is not None else 32
    intra_procs = max(2, max(s.devices for s in mine))
    inter_here = many and server is None
    # Servers not emulated run on this node's GPU when it has one (profiler/common.py:resolve_target).
    on_cuda = any(s.emulate is None for s in mine) and detect_devices().backend == "cuda"
    # A server of one GPU never all-reduces within itself, and NCCL refuses two ranks on one GPU.
    need_intra = (server is None or mine[0].devices > 1) and not (on_cuda and all(s.devices == 1 for s in mine))
    sweep = lbs_values or [start * k for k in range(1, 17) if bound is None or start * k <= max(start, bound)]
    # A server whose computation profiles are on disk for every planned LBS costs next to nothing.
    comp_dir = loaded.profile_dirs().computation
    measured = {x.name for x in mine if not force and all((comp_dir / str(b) / x.name).is_dir() for b in sweep)}
    comm_dir = loaded.profile_dirs().communication
    comm_weight = {
        kind: 0.0 if not force and comm_profile_path(comm_dir, kind).is_file() else FIXED_S[kind]
        for kind in ("intra", "inter")
    }
    comm_s = comm_weight["intra"] * need_intra + comm_weight["inter"] * inter_here
    # The hybrid planner plans the job (a model no device holds whole is fine); its profiles are measured here
    # unless this is one node's server of a cluster.
    planned_hybrid = hybrid or loaded.config.parallel is not None
    hybrid = planned_hybrid and server is None
    comm_s += FIXED_S["hybrid"] * hybrid
    expected = expected_seconds(sweep, bound, len(mine) - len(measured), comm_s, cuda=on_cuda)
    weights = {x.name: (0.0, 0.0) if x.name in measured else (expected["mem"], expected["comp"]) for x in mine}
    run = SuiteRun(gbs_max=bound, lbs_values=lbs_values, expected_s=expected["total"])
    total, done = expected["total"], 0.0
    planned = f"LBS {', '.join(map(str, lbs_values))}" if lbs_values else f"LBS from {start} in steps of {start}"
    reporter.note(
        f"plan: {planned} on {', '.join(s.name for s in mine)}"
        + (f" (GBS up to {bound})" if bound else "")
        + f"; expected to take about {_minutes(expected['total'])}"
    )
    budget = PointBudget(
        seconds=POINT_SECONDS,
        overlap_once=True,
        stop_vsw=True,
        repeats=SHORT_POINT_RUNS,
        repeat_below_ms=SHORT_POINT_MS,
    )

    def stage(name: str, weight: float, work: Callable[[Reporter], str]) -> bool:
        nonlocal done
        sub = ShareReporter(reporter, done, weight, total, f"{name}: ")  # "intra: ..." named once
        sub.progress(0, 1, "starting")
        began = time.monotonic()
        try:
            run.stages.append(StageResult(name, True, work(sub)))
        except (RuntimeFailure, InputError) as exc:
            run.stages.append(StageResult(name, False, "; ".join(exc.lines())))
            reporter.note(f"{name}: failed: {'; '.join(exc.lines())}")
        run.stages[-1].seconds = time.monotonic() - began
        done += weight
        reporter.progress(done, total, f"{name}: done")
        return run.stages[-1].ok

    bucket_mib: list[float] = []

    def bucket(sub: Reporter) -> str:
        result = profile_buckets(loaded, force=force, reporter=sub)
        bucket_mib.extend(result.profile.bucket_size_distribution)
        run.bucket_mib = list(bucket_mib)
        count = f"{len(bucket_mib)} bucket{'s' if len(bucket_mib) != 1 else ''}"
        return f"{count}, {sum(bucket_mib):.3g} MB" + (" (on disk)" if result.skipped else "")

    stage("bucket", expected["bucket"], bucket)
    fitting: dict[str, bool] = {}
    """Per server: does a whole replica fit its memory at some LBS (else there is nothing to time)?"""
    for s in mine:

        def mem(sub: Reporter, s: ServerConfig = s) -> str:
            max_lbs = max(start, bound) if bound is not None else None
            result = profile_memory(
                loaded,
                server=s.name,
                lbs=start,
                max_lbs=max_lbs,
                force=force,
                reporter=sub,
                gbs_max=bound,
                lbs_values=lbs_values,
            )
            fits = [f"LBS {r.lbs}: {r.max_num_models}" for r in result.results if r.max_num_models > 0]
            fitting[s.name] = bool(fits)
            return "most VSWs " + ", ".join(fits) if fits else "nothing fits"

        def comp(sub: Reporter, s: ServerConfig = s) -> str:
            result = profile_comp(loaded, server=s.name, iters=iters, force=force, reporter=sub, budget=budget)
            measured = sum(not r.skipped for r in result.results)
            threads = result.target.threads
            each = f", {threads} thread{'s' if threads != 1 else ''} each" if threads is not None else ""
            return f"{len(result.results)} points ({measured} measured now){each}"

        if stage(f"mem {s.name}", weights[s.name][0], mem) and not fitting.get(s.name, True):
            # A model no device holds whole has no data-parallel timings; the hybrid planner splits it.
            done += weights[s.name][1]
            why = "no LBS fits its memory" + ("; the hybrid profiles plan it" if planned_hybrid else "")
            run.stages.append(StageResult(f"comp {s.name}", planned_hybrid, f"not measured: {why}"))
        elif run.stages[-1].ok:
            stage(f"comp {s.name}", weights[s.name][1], comp)
        else:
            done += weights[s.name][1]
            run.stages.append(StageResult(f"comp {s.name}", False, "not measured: its memory profile failed"))
    message_sizes = sizes or comm_sizes(bucket_mib)

    def comm(sub: Reporter, kind: str) -> str:
        if kind == "intra":
            result = profile_comm(
                loaded, server=mine[0].name, sizes=message_sizes, nprocs=intra_procs, force=force, reporter=sub
            )
        else:
            result = profile_comm(
                loaded, server=mine[0].name, sizes=message_sizes, loopback_nodes=len(mine), force=force, reporter=sub
            )
        meta = result.profile.meta
        procs = f"{meta.world_size} processes, " if meta is not None else ""
        return f"{procs}{len(result.profile.measured_ms)} sizes ({message_sizes} MB)" + (
            " (on disk)" if result.skipped else ""
        )

    if need_intra:
        stage("intra", comm_weight["intra"], lambda sub: comm(sub, "intra"))
    if inter_here:
        stage("inter", comm_weight["inter"], lambda sub: comm(sub, "inter"))
    if hybrid:
        stage("hybrid", FIXED_S["hybrid"], lambda sub: _hybrid(loaded, force, sub))
    if server is not None and many:
        run.commands = inter_commands(loaded)
    return run


def _hybrid(loaded: LoadedConfig, force: bool, reporter: Reporter) -> str:
    from jabascli.profiler.hybrid import profile_hybrid

    result = profile_hybrid(loaded, force=force, reporter=reporter)
    where = f"{result.model}, {', '.join(result.devices)}"
    return f"{where} (on disk)" if result.skipped else where


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def failure_error(run: SuiteRun) -> JabasError | None:
    """The run's failures as one error (exit code 1), or None."""
    if not run.failures:
        return None
    return RuntimeFailure([f"{s.name} failed: {s.detail}" for s in run.failures])
