"""Performance-model accuracy: predicted against measured iteration time, on this machine's CPU.

A job of two servers with one device each, ``slow`` emulated ``--slowdown``
times slower than ``fast`` (4 by default: longer iterations, so that this
virtual machine's millisecond-scale scheduling hiccups weigh less, and
plans that need up to 9 micro-steps on ``fast`` to balance ``slow``), trains
a small real workload in two gloo processes with one torch thread each: the
tiny ResNet at LBS 2 and 4 by default (``--workload digits`` trains the quick
start's CNN, whose 1,437 samples make an epoch, with validation and a
checkpoint, every few iterations). The script:

1. writes the job config in a work folder (a temporary one unless ``--workdir``);
2. profiles the job with the real profilers, as a user would: ``jabas profile
   mem`` and ``comp`` for each server, ``bucket``, and ``comm`` as an
   inter-node profile of two local "nodes" (the job spans two servers);
3. for each configuration (LBS, VSW and GA per server, weight sync) writes a
   plan file and trains it with ``jabas run --plan ... --max-steps N``, two
   ``jabas train`` processes; the measured iteration time is read from the
   run's ``steps.csv`` (rank 0 writes a row every 0.25 s with the median
   duration of the iterations since the previous row, ``iteration_s``): the
   median over the rows after the first ``--warmup`` iterations, each row
   counted once per iteration it covers;
4. predicts each plan with the performance model (``Solver.predict``) and
   prints predicted and measured ms and the absolute percentage error per
   configuration, then ``MdAPE=X%``, the median of those errors.

A shared machine's speed drifts with what else runs on it, by tens of percent
over minutes. So the computation and all-reduce profiles are measured again
after every configuration, and each configuration is predicted from the
profiles measured just before and just after its run (the mean of the two
predictions): the run is bracketed by its profiles, and a drift between them
cancels to first order instead of being counted as the model's error.
``--profile-once`` profiles once, at the start, as a user would (quicker; on a
busy machine the drift then shows in the errors).

The model treats devices as independent, as GPUs are. Two processes on one
CPU are not always: they share caches, memory bandwidth, and on some virtual
machines one physical core, and communication runs on the same cores. So the
script first runs a *host check*: one rank's training step alone and two at
once; a ratio well above 1.0 means this host cannot emulate independent
devices with this workload now (another job running, or a workload too large
for the caches), and errors will be inflated by that, not by the model.

Timings on a shared machine are noisy: this prints figures, it asserts nothing.
With ``--workdir DIR`` the profiles are kept and reused by the next run (the
profilers skip files already on disk); ``--reprofile`` measures them again.

    .venv/bin/python benchmarks/model_accuracy.py [--workload resnet|digits] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.config import load_config
from jabascli.net import free_port
from jabascli.solver import solver_from_config
from jabascli.solver.plan import Assignment, Plan, write_plan

TARGET_MDAPE = 10.0

# workload, [job] options, default LBS pair (small, large), default slowdown of server "slow"
WORKLOADS: dict[str, tuple[str, str, tuple[int, int], float]] = {
    # the tiny ResNet on generated 32x32 images: 1.2 MB of gradients, in two buckets; at LBS 2 and 4 two
    # ranks run side by side at the speed of one alone on the development machine (not at LBS 8 and up)
    "resnet": ("resnet", '{ variant = "tiny", synthetic_size = 200000 }', (2, 4), 4.0),
    # scikit-learn's handwritten digits, the CNN of the quick start: 38 KB of gradients; slowed 3x as in
    # issue #13's two-server example
    "digits": ("digits", "{ width = 16 }", (32, 64), 3.0),
}

CONFIG = """\
[job]
name = "accuracy"
workload = "{workload}"
epochs = 1000
lbs = {lbs}
options = {options}

[profiles]
dir = "{folder}/profiles"

[[cluster.servers]]
name = "fast"
device_type = "cpu"
devices = 1
memory_bytes = 8_000_000_000

[[cluster.servers]]
name = "slow"
device_type = "cpu-slow"
devices = 1
emulate = {{ slowdown = {slowdown}, memory_bytes = 8_000_000_000 }}

[storage]
run_dir = "{folder}/runs"
checkpoint_dir = "{folder}/checkpoints"
"""

# (LBS index into the pair, (VSW, GA) on "fast", (VSW, GA) on "slow", weight sync): plans bound by the
# slow server, balanced, and bound by the fast one (for the default slowdown of 4); VSW 1..3, GA 0..2, both
# methods. A VSW count above what the memory profile allows is lowered to it.
CONFIGS: list[tuple[int, tuple[int, int], tuple[int, int], str]] = [
    (0, (1, 0), (1, 0), "sequential"),
    (0, (2, 1), (1, 0), "overlap"),
    (0, (3, 1), (1, 0), "sequential"),
    (0, (3, 2), (1, 1), "overlap"),
    (0, (2, 0), (1, 0), "sequential"),
    (1, (1, 0), (1, 0), "overlap"),
    (1, (2, 1), (1, 0), "sequential"),
    (1, (3, 2), (2, 0), "overlap"),
    (1, (3, 0), (1, 0), "sequential"),
    (1, (1, 2), (1, 1), "overlap"),
]

# Digits, slow server 3x slower: plans the solver finds for GBS 128-256 on this pair, balanced (the fast
# server runs about three times the slow one's micro-steps), where a synchronous iteration waits for both.
DIGITS_CONFIGS: list[tuple[int, tuple[int, int], tuple[int, int], str]] = [
    (1, (1, 2), (1, 0), "sequential"),
    (1, (3, 0), (1, 0), "sequential"),
    (0, (3, 1), (1, 1), "sequential"),
    (0, (1, 2), (1, 0), "overlap"),
    (1, (2, 1), (1, 0), "overlap"),
    (0, (3, 0), (1, 0), "sequential"),
]
CONFIGS_OF = {"resnet": CONFIGS, "digits": DIGITS_CONFIGS}


@dataclass
class Result:
    name: str
    predicted_s: float
    measured_s: float
    steps: int

    @property
    def error(self) -> float:
        """Signed percentage error: positive when the model predicts a slower iteration than measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s * 100


def jabas(*args: str, log: Path, env: dict[str, str] | None = None) -> None:
    """``jabas ARGS`` in a subprocess (``env``, else this one's); its output goes to ``log`` (shown if it fails)."""
    command = [sys.executable, "-m", "jabascli", *args]
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ jabas {' '.join(args)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        sys.stdout.write(log.read_text(encoding="utf-8")[-4000:])
        raise SystemExit(f"`jabas {' '.join(args)}` failed with exit code {code} (log: {log})")


def profile_structure(
    config: Path, folder: Path, lbs: tuple[int, int], args: argparse.Namespace, env: dict[str, str]
) -> None:
    """Memory and bucket profiles: they do not depend on the machine's load (tensor bytes, DDP's buckets)."""
    log = folder / "profile.log"
    force = ["--force"] if args.reprofile else []
    common = ["-c", str(config), "--threads", "1", *force]
    for server in ("fast", "slow"):
        jabas(
            "profile", "mem", *common, "--server", server, "--lbs", str(lbs[0]), "--lbs-step", str(lbs[0]),
            "--max-lbs", str(lbs[1]), "--max-vsw", str(args.max_vsw), log=log, env=env,
        )  # fmt: skip
    jabas("profile", "bucket", "-c", str(config), *force, log=log, env=env)


def profile_times(config: Path, folder: Path, args: argparse.Namespace, env: dict[str, str], force: bool) -> None:
    """Computation profiles of both servers and the all-reduce profile: what a busy machine changes."""
    log = folder / "profile.log"
    again = ["--force"] if force else []
    for server in ("fast", "slow"):
        jabas(
            "profile", "comp", "-c", str(config), "--threads", "1", "--server", server, "--iters", str(args.comp_iters),
            *again, log=log, env=env,
        )  # fmt: skip
    # The job spans two servers, so the model uses the inter-node profile.
    profile_comm_across_nodes(config, folder, args.comm_sizes, env, force)


def profile_comm_across_nodes(
    config: Path, folder: Path, sizes: str, env: dict[str, str] | None = None, force: bool = False
) -> None:
    """The inter-node all-reduce profile: two "nodes" of one process each, servers fast (rank 0) and slow."""
    log = folder / "profile.log"
    comm = ["profile", "comm", "-c", str(config), "--nprocs", "1", "--world", "2"]
    comm += ["--master", f"127.0.0.1:{free_port()}", "--sizes", sizes, *(["--force"] if force else [])]
    log1 = folder / "profile-comm-rank1.log"
    with log1.open("w", encoding="utf-8") as out:
        rank1 = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jabascli",
                *comm,
                "--server",
                "slow",
                "--rank",
                "1",
                "--out",
                str(folder / "comm1"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            jabas(*comm, "--server", "fast", "--rank", "0", log=log, env=env)
        finally:
            if rank1.wait(timeout=600) != 0:
                raise SystemExit(f"the rank-1 comm profiler failed (log: {log1})")


def _host_check_worker(config: str, lbs: int, seconds: float, barrier: Any, results: Any) -> None:
    import torch

    from jabascli.engine.distributed import DistEnv, init_process_group
    from jabascli.profiler.step import EngineStep
    from jabascli.workload import load_workload

    torch.set_num_threads(1)
    job = load_config(config).config.job
    init_process_group(DistEnv(0, 1, 0, None, None), torch.device("cpu"))
    step = EngineStep(load_workload(job.workload, job.options, job.data), lbs, 1, "cpu")
    for _ in range(5):
        step.run()
    barrier.wait()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        times.append(step.run().total)
    results.put(statistics.median(times))


def host_check(config: Path, lbs: int, seconds: float = 2.0) -> tuple[float, float]:
    """Median ms of one rank's training step (1 VSW) alone, and with a second one running at the same time."""
    ctx = multiprocessing.get_context("spawn")
    medians: dict[int, list[float]] = {1: [], 2: []}
    for n in (1, 2, 1, 2):
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(target=_host_check_worker, args=(str(config), lbs, seconds, barrier, results)) for _ in range(n)
        ]
        for p in procs:
            p.start()
        medians[n] += [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
    return statistics.median(medians[1]), statistics.median(medians[2])


def report_host_check(config: Path, lbs: int, when: str) -> None:
    alone, paired = host_check(config, lbs)
    ratio = paired / alone
    warning = "" if ratio <= 1.15 else "  <- not independent: errors below are inflated by this host, not the model"
    print(
        f"host check {when}, LBS {lbs}: one rank's step {alone:.2f} ms alone, {paired:.2f} ms with another "
        f"running (x{ratio:.2f}; 1.00 = independent devices){warning}"
    )


def predict(config: Path, plan: Plan) -> Any:
    """The performance model's prediction of ``plan`` from the profiles now on disk."""
    return solver_from_config(load_config(config)).predict(plan)


def make_plan(
    config: Path, path: Path, lbs: int, fast: tuple[int, int], slow: tuple[int, int], weight_sync: str
) -> Plan:
    """A plan of (VSW, GA) per server, VSW lowered to what the memory profile allows, with the model's
    prediction from the profiles now on disk; written to ``path`` for ``jabas run --plan``."""
    solver = solver_from_config(load_config(config))
    servers = {s.name: s for s in solver.servers}
    pairs = {"fast": fast, "slow": slow}
    assignments = []
    for name, (vsw, ga) in pairs.items():
        server = servers[name]
        vsw = max(1, min(vsw, solver.model.device(server.profile_server, lbs).max_vsw))
        assignments.append(Assignment(name, server.device_type, 1, vsw, ga))
    draft = Plan(lbs * sum(a.workers for a in assignments), lbs, weight_sync, 1.0, 1.0, tuple(assignments))
    prediction = solver.predict(draft)
    timed = tuple(
        Assignment(a.server, a.device_type, 1, a.vsw, a.ga, g.time_s)
        for a, g in zip(assignments, prediction.groups, strict=True)
    )
    plan = Plan(draft.gbs, lbs, weight_sync, prediction.time_s, prediction.throughput, timed)
    write_plan(path, plan)
    return plan


def measured_time(steps_csv: Path, warmup: int) -> tuple[float, int]:
    """Median iteration time (s) over the steps after ``warmup``, and how many steps it covers."""
    times: list[float] = []
    previous = 0
    with steps_csv.open(encoding="utf-8") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            covered, first = step - previous, previous + 1
            previous = step
            if first > warmup and covered > 0:
                times += [float(row["iteration_s"])] * covered
    if not times:
        raise SystemExit(f"{steps_csv}: no steps after the {warmup} warm-up steps; run more (--seconds)")
    return statistics.median(times), len(times)


def describe(lbs: int, fast: tuple[int, int], slow: tuple[int, int], weight_sync: str) -> str:
    return f"LBS {lbs:>2}  fast VSW {fast[0]} GA {fast[1]}  slow VSW {slow[0]} GA {slow[1]}  {weight_sync:<10}"


def breakdown(prediction: Any) -> str:
    parts = []
    for g in prediction.groups:
        b = g.breakdown
        parts.append(
            f"{g.group.server.name}: data {b.data_s * 1e3:.2f} fwd {b.forward_s * 1e3:.2f} "
            f"bwd {b.backward_s * 1e3:.2f} comm {b.exposed_comm_s * 1e3:.2f} update {b.update_s * 1e3:.2f} "
            f"overhead {b.overhead_s * 1e3:.2f} sync wait {b.sync_wait_s * 1e3:.2f} = {b.total_s * 1e3:.2f}"
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload", choices=[*sorted(WORKLOADS), "all"], default="all",
        help="what to train (default all: the tiny ResNet, then digits; MdAPE over every configuration)",
    )  # fmt: skip
    parser.add_argument(
        "--lbs", type=lambda t: tuple(int(x) for x in t.split(",")),
        help="the two local batch sizes SMALL,LARGE, LARGE a multiple of SMALL (default: digits 32,64; resnet 2,4)",
    )  # fmt: skip
    parser.add_argument(
        "--slowdown", type=float, help="emulated slowdown of server 'slow' (default: resnet 4, digits 3)"
    )
    parser.add_argument("--workdir", type=Path, help="keep the config, profiles and runs here (default: a temp folder)")
    parser.add_argument("--reprofile", action="store_true", help="measure the profiles again even if on disk")
    parser.add_argument(
        "--profile-once", action="store_true",
        help="profile once at the start instead of around every configuration (quicker, but the machine's drift "
        "in speed then counts as the model's error)",
    )  # fmt: skip
    parser.add_argument("--max-vsw", type=int, default=3, help="largest VSW count profiled (default 3)")
    parser.add_argument("--comp-iters", type=int, default=20, help="jabas profile comp --iters (default 20)")
    parser.add_argument("--comm-sizes", default="0.03125:2", help="jabas profile comm --sizes, MB (default 0.03125:2)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations not measured at the start (default 5)")
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="train about this long per configuration (default 6)"
    )
    parser.add_argument("--min-steps", type=int, default=40, help="measure at least this many iterations (default 40)")
    parser.add_argument("--configs", type=int, help="run the first N configurations of each workload")
    parser.add_argument("--no-host-check", action="store_true", help="skip the check that two ranks run independently")
    parser.add_argument("--breakdown", action="store_true", help="also print the model's breakdown per configuration")
    args = parser.parse_args()
    if args.lbs is not None and (len(args.lbs) != 2 or args.lbs[1] % args.lbs[0]):
        parser.error("--lbs: give SMALL,LARGE with LARGE a multiple of SMALL")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one thread per process: 2 on 2 cores
    os.environ["OMP_NUM_THREADS"] = "1"
    names = sorted(WORKLOADS, reverse=True) if args.workload == "all" else [args.workload]  # resnet, then digits
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="jabas-accuracy-") as tmp:
        root = (args.workdir or Path(tmp)).resolve()
        for name in names:
            folder = root / name if len(names) > 1 else root
            results += run_workload(name, folder, args, env)
    mdape = statistics.median(abs(r.error) for r in results)
    signed = statistics.median(r.error for r in results)
    print(f"median signed error {signed:+.1f}% (negative: the model predicts faster iterations than measured)")
    print(f"MdAPE={mdape:.1f}%  (target <= {TARGET_MDAPE:g}%; {len(results)} configurations: {', '.join(names)})")


def run_workload(name: str, folder: Path, args: argparse.Namespace, env: dict[str, str]) -> list[Result]:
    """Profile, train and predict every configuration of one workload."""
    workload, options, default_lbs, default_slowdown = WORKLOADS[name]
    lbs_pair: tuple[int, int] = args.lbs or default_lbs
    slowdown = args.slowdown or default_slowdown
    configs = CONFIGS_OF[name][: args.configs]
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "jabas.toml"
    text = CONFIG.format(workload=workload, options=options, lbs=lbs_pair[0], folder=folder, slowdown=slowdown)
    config.write_text(text, encoding="utf-8")
    print(f"workload {name} {options}, LBS {lbs_pair[0]} and {lbs_pair[1]}, slow server x{slowdown:g}")
    if not args.no_host_check:
        for lbs in lbs_pair:
            report_host_check(config, lbs, "before")
    start = time.perf_counter()
    profile_structure(config, folder, lbs_pair, args, env)
    profile_times(config, folder, args, env, force=args.reprofile or not args.profile_once)
    print(f"profiled in {time.perf_counter() - start:.0f} s: {folder / 'profiles'}")
    if not args.profile_once:
        print("each configuration is predicted from the profiles measured just before and just after its run")
    print(f"{'configuration':<59} {'predicted':>10} {'measured':>10} {'APE':>7}  iterations")

    results: list[Result] = []
    for index, (which, fast, slow, weight_sync) in enumerate(configs):
        plan = make_plan(config, folder / f"plan{index}.json", lbs_pair[which], fast, slow, weight_sync)
        steps = args.warmup + max(args.min_steps, math.ceil(args.seconds / plan.iteration_time_s))
        jabas(
            "run", "-c", str(config), "--plan", str(folder / f"plan{index}.json"), "--max-steps", str(steps),
            "--json", log=folder / f"run{index}.log", env=env,
        )  # fmt: skip
        measured, counted = measured_time(folder / "runs" / "accuracy" / "steps.csv", args.warmup)
        if not args.profile_once:
            profile_times(config, folder, args, env, force=True)
        latest = predict(config, plan)  # from the profiles measured after the run (bracketing)
        predicted = plan.iteration_time_s if args.profile_once else (plan.iteration_time_s + latest.time_s) / 2
        by_server = {a.server: (a.vsw, a.ga) for a in plan.assignments}
        label = f"{name:<6} " + describe(plan.lbs, by_server["fast"], by_server["slow"], weight_sync)
        result = Result(label, predicted, measured, counted)
        results.append(result)
        print(
            f"{result.name:<59} {result.predicted_s * 1e3:>7.2f} ms {result.measured_s * 1e3:>7.2f} ms "
            f"{abs(result.error):>6.1f}%  {result.steps}"
        )
        if args.breakdown:
            print(f"    model: {breakdown(latest)}")
        sys.stdout.flush()

    if not args.no_host_check:
        report_host_check(config, lbs_pair[0], "after")
    mdape = statistics.median(abs(r.error) for r in results)
    print(f"{name}: MdAPE {mdape:.1f}% over {len(results)} configurations")
    return results


if __name__ == "__main__":
    main()
