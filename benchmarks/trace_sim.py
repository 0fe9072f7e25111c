"""jabas against its baselines and hindsight on public measurements of real training runs (issue #23).

For each traced job (imagenet: ResNet-50; cifar10: ResNet-18; bert: BERT on
SQuAD) and each cluster (Sia's default ``aws:6,dgx-ext:2,rtx:3``, the small mixed
``aws:2,rtx:1,azure:1`` and two more of three GPU types), runs every policy of
``jabascli.simulate`` and prints, for ``jabas`` and ``jabas-similarity``:

- ``t/base``: time over the soonest baseline (``fixed-*``, ``ddp-all``, ``pollux``); target <= 1.00;
- ``t/oracle``: time over the hindsight oracle's; target <= 1.05;
- ``t/pollux``: time over pollux's; target on imagenet <= 0.80; where the oracle's own time over
  pollux's (``o/pollux``, printed per case) is above 0.80, no policy can reach it on that cluster
  and the verdict says ``unreachable`` with the oracle's ratio rather than a miss;
- ``c/base``: cost over the cheapest baseline that is no sooner (``-``: every baseline is slower);
- ``moves``: allocation changes (each a checkpoint-restart);

then, for jabas run with ``--objective time``, ``cost`` and ``no-dearer``, the
baselines both sooner and cheaper than it (the Pareto check: there must be none).
``cpu_s`` is the CPU time of a case's three simulations (one per objective, every policy in each; one core).

    .venv/bin/python benchmarks/trace_sim.py [--traces DIR] [--json OUT] [--jobs imagenet,cifar10]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jabascli.simulate import TraceResult, simulate_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "reference" / "sia-traces"
JOBS = ("imagenet", "cifar10", "bert")
CLUSTERS = ("aws:6,dgx-ext:2,rtx:3", "aws:2,rtx:1,azure:1", "azure:1,quad:2,aws:2", "dgx-ext:1,rtx:1,quad:2")
OBJECTIVES = ("time", "cost", "no-dearer")


def ratios(result: TraceResult, name: str) -> dict[str, float | None]:
    policy, oracle, pollux = result.get(name), result.get("oracle"), result.get("pollux")
    cmp = result.comparison()
    assert policy is not None and oracle is not None and pollux is not None and cmp is not None
    soonest = min(p.time_s for p in result.policies if p.policy.startswith(("fixed", "ddp-all", "pollux")))
    return {
        "t/base": policy.time_s / soonest,
        "t/oracle": policy.time_s / oracle.time_s,
        "t/pollux": policy.time_s / pollux.time_s,
        "o/pollux": oracle.time_s / pollux.time_s,
        "c/base": result.cost_at_no_greater_time(name),
        "moves": float(policy.moves),
    }


def verdict(job: str, r: dict[str, float | None]) -> str:
    missed = []
    if r["t/base"] is not None and r["t/base"] > 1.0 + 1e-9:
        missed.append("base")
    if r["t/oracle"] is not None and r["t/oracle"] > 1.05:
        missed.append("oracle")
    unreachable = ""
    if job == "imagenet" and r["t/pollux"] is not None and r["t/pollux"] > 0.80:
        if r["o/pollux"] is not None and r["o/pollux"] > 0.80:
            unreachable = f" (pollux: unreachable, oracle {r['o/pollux']:.3f})"
        else:
            missed.append("pollux")
    return ("met" if not missed else "MISSED " + ",".join(missed)) + unreachable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder holding imagenet/, cifar10/, bert/")
    parser.add_argument("--json", type=Path, default=None, help="also write every result (with timelines) here")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs (default: all three)")
    args = parser.parse_args()

    everything = []
    rows = []
    for job in args.jobs.split(","):
        for cluster in CLUSTERS:
            cpu = time.process_time()
            result = simulate_trace(args.traces / job, cluster)
            beaten = {"time": result.dominating()}
            for objective in OBJECTIVES[1:]:
                other = simulate_trace(args.traces / job, cluster, objective=objective)
                beaten[objective] = other.dominating()
            cpu = time.process_time() - cpu
            rows.append((job, cluster, ratios(result, "jabas"), ratios(result, "jabas-similarity"), beaten, cpu))
            everything.append(result.to_json())

    def cells(r: dict[str, float | None]) -> str:
        c = "-" if r["c/base"] is None else f"{r['c/base']:.3f}"
        return (
            f"{r['t/base']:7.3f} {r['t/oracle']:8.3f} {r['t/pollux']:8.3f} {r['o/pollux']:8.3f} {c:>7}"
            f" {int(r['moves'] or 0):5d}"
        )

    head = f"{'t/base':>7} {'t/oracle':>8} {'t/pollux':>8} {'o/pollux':>8} {'c/base':>7} {'moves':>5}"
    print("## jabas (goodput) and jabas-similarity against the best baseline and the oracle")
    print(f"{'job':<9} {'cluster':<23} | jabas: {head} {'targets':<42} | similarity: {head} | {'cpu_s':>5}")
    for job, cluster, jabas, similarity, _, cpu in rows:
        print(
            f"{job:<9} {cluster:<23} | jabas: {cells(jabas)} {verdict(job, jabas):<42}"
            f" | similarity: {cells(similarity)} | {cpu:5.1f}"
        )
    print("\n## Pareto check: baselines both sooner and cheaper than jabas, per --objective (none is the target)")
    print(f"{'job':<9} {'cluster':<23} " + " ".join(f"{o:<22}" for o in OBJECTIVES))
    for job, cluster, _, _, beaten, _ in rows:
        print(f"{job:<9} {cluster:<23} " + " ".join(f"{','.join(beaten[o]) or 'none':<22}" for o in OBJECTIVES))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
