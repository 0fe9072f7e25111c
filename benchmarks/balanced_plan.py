"""Why a balanced two-server plan runs slower than its slower rank: a measurement, not a guess.

One plan of two ranks (``fast``: a CPU device, ``slow``: one emulated
``--slowdown`` times slower, digits by default), each rank the engine's own
``Trainer`` with the phase timer the computation profiler uses, run three ways
for ``--iters`` iterations after ``--warmup``:

1. **alone**: each rank by itself in a one-process group, one after the other
   (what ``jabas profile comp`` measures);
2. **side by side**: both ranks at once, each in its own one-process group, so
   they share the machine but never wait for each other;
3. **synchronised**: both in one two-process gloo group, as ``jabas run`` trains
   the plan: every iteration ends with the all-reduce, so the faster rank waits.

Compared: (2) against (1) is what sharing the machine costs (an emulation
artefact of one CPU standing for two devices); the expected maximum of the two
ranks' per-iteration times in (2), paired at random, against their medians is
what per-iteration variance costs a synchronous iteration; and (3) against
that, plus the inter-node all-reduce, is whatever is left (the all-reduce at
small sizes, a rank woken late from its wait ...).

    .venv/bin/python benchmarks/balanced_plan.py [--lbs 64 --fast 1,2 --slow 1,0 --slowdown 3]

Timings on a shared machine are noisy: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from jabascli.net import free_port

PLAN_FIELDS = ("server", "vsw", "ga", "slowdown")


class _Timer:
    """Phase boundaries (the engine's PhaseTimer interface): seconds per phase in the current iteration."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def take(self) -> dict[str, float]:
        phases, self.phases = self.phases, {}
        self.last = time.perf_counter()
        return phases


def _worker(
    ranks: list[dict[str, Any]],
    rank: int,
    world: int,
    port: int | None,
    lbs: int,
    workload_args: dict[str, Any],
    iters: int,
    warmup: int,
    barrier: Any,
    results: Any,
) -> None:
    import torch

    from jabascli.config.loader import LoadedConfig
    from jabascli.config.models import JabasConfig, JobConfig
    from jabascli.engine.distributed import DistEnv, init_process_group
    from jabascli.engine.options import TrainOptions
    from jabascli.engine.plan import RankPlan, TrainingPlan
    from jabascli.engine.sampler import Iteration, MicroBatch
    from jabascli.engine.trainer import Trainer

    torch.set_num_threads(1)
    env = DistEnv(rank, world, 0, "127.0.0.1" if port else None, port)
    init_process_group(env, torch.device("cpu"))
    job = JobConfig(name="balanced", **workload_args)
    loaded = LoadedConfig(JabasConfig(job=job), Path("balanced_plan.py"), "toml")
    mine = ranks if world == len(ranks) else [ranks[rank if world > 1 else 0]]
    plan_ranks = tuple(
        RankPlan(i, r["server"], r["server"], r["vsw"], r["ga"], r["slowdown"], emulated=r["slowdown"] > 1)
        for i, r in enumerate(mine)
    )
    plan = TrainingPlan(lbs, plan_ranks, "sequential")
    trainer = Trainer(loaded, plan, rank if world > 1 else 0, torch.device("cpu"), TrainOptions(metrics=False))
    timer = _Timer()
    trainer.set_timer(timer)
    me = plan.rank(rank if world > 1 else 0)
    size = len(trainer.train_set)
    generator = torch.Generator().manual_seed(rank)

    def iteration() -> Any:
        batches = []
        offset = plan.worker_offset(me.rank)
        for v in range(me.vsw):
            for g in range(me.ga + 1):
                indices = torch.randint(size, (lbs,), generator=generator).tolist()
                batches.append(MicroBatch(offset + v * (me.ga + 1) + g, v, g, 0, indices, 0))
        return Iteration(0, 0, batches)

    for _ in range(warmup):
        trainer.train_step(iteration())
    barrier.wait()
    totals, phases = [], []
    for _ in range(iters):
        batch = iteration()
        timer.take()
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(batch)
        totals.append(time.perf_counter() - start)
        phases.append({**timer.take(), "cpu": time.process_time() - cpu})
    results.put((me.server, totals, phases))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(
    ranks: list[dict[str, Any]], mode: str, lbs: int, workload_args: dict[str, Any], iters: int, warmup: int
) -> dict[str, tuple[list[float], list[dict[str, float]]]]:
    """Per server: its per-iteration seconds and phases, in ``mode`` alone / side / sync."""
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, tuple[list[float], list[dict[str, float]]]] = {}
    groups = [[i] for i in range(len(ranks))] if mode == "alone" else [list(range(len(ranks)))]
    for group in groups:
        barrier, results = ctx.Barrier(len(group)), ctx.Queue()
        port = free_port() if mode == "sync" else None
        world = len(ranks) if mode == "sync" else 1
        procs = []
        for i in group:
            who = ranks if mode == "sync" else [ranks[i]]
            args = (who, i if mode == "sync" else 0, world, port, lbs, workload_args, iters, warmup, barrier, results)
            procs.append(ctx.Process(target=_worker, args=args))
        for p in procs:
            p.start()
        for _ in procs:
            server, totals, phases = results.get(timeout=600)
            out[server] = (totals, phases)
        for p in procs:
            p.join()
    return out


def expected_max(a: list[float], b: list[float], draws: int = 20000) -> float:
    """E[max(X, Y)] for X, Y drawn independently from two samples."""
    rng = random.Random(0)
    return statistics.fmean(max(rng.choice(a), rng.choice(b)) for _ in range(draws))


def ms(x: float) -> str:
    return f"{x * 1e3:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lbs", type=int, default=64)
    parser.add_argument("--fast", default="1,2", help="VSW,GA of the fast rank (default 1,2)")
    parser.add_argument("--slow", default="1,0", help="VSW,GA of the slow rank (default 1,0)")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--options", default='{"width": 16}', help="workload options as JSON")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    fv, fg = (int(x) for x in args.fast.split(","))
    sv, sg = (int(x) for x in args.slow.split(","))
    ranks = [
        {"server": "fast", "vsw": fv, "ga": fg, "slowdown": 1.0},
        {"server": "slow", "vsw": sv, "ga": sg, "slowdown": args.slowdown},
    ]
    workload_args = {"workload": args.workload, "options": json.loads(args.options)}
    print(f"{args.workload} LBS {args.lbs}: fast VSW {fv} GA {fg}, slow x{args.slowdown:g} VSW {sv} GA {sg}")
    modes = ("alone", "side", "sync")
    found = {mode: run(ranks, mode, args.lbs, workload_args, args.iters, args.warmup) for mode in modes}
    for mode in modes:
        cells = []
        for server in ("fast", "slow"):
            totals = found[mode][server][0]
            q = statistics.quantiles(totals, n=4)
            cells.append(f"{server} median {ms(statistics.median(totals))} (p25 {ms(q[0])}, p75 {ms(q[2])})")
        print(f"{mode:<6} " + "; ".join(cells))
    alone = {s: statistics.median(found["alone"][s][0]) for s in ("fast", "slow")}
    side = {s: statistics.median(found["side"][s][0]) for s in ("fast", "slow")}
    sync = statistics.median(found["sync"]["fast"][0])
    emax_side = expected_max(found["side"]["fast"][0], found["side"]["slow"][0])
    emax_alone = expected_max(found["alone"]["fast"][0], found["alone"]["slow"][0])
    print(f"max of the medians alone       {ms(max(alone.values()))}   (what the model predicts, before all-reduce)")
    print(f"E[max] of the ranks alone      {ms(emax_alone)}   (+ per-iteration variance)")
    print(f"max of the medians side by side {ms(max(side.values()))}   (+ sharing the machine)")
    print(f"E[max] side by side            {ms(emax_side)}   (+ both)")
    print(f"synchronised, measured         {ms(sync)}   (the plan as jabas run trains it)")
    print("phase medians (bwd holds the last micro-step's all-reduce and any wait for the other rank):")
    for mode in ("alone", "side", "sync"):
        for server in ("fast", "slow"):
            phases = found[mode][server][1]
            names = sorted({k for p in phases for k in p})
            cells = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in phases) * 1e3:.2f}" for k in names)
            print(f"  {mode:<6} {server}: {cells}")


if __name__ == "__main__":
    main()
