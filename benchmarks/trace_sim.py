"""jabas against its baselines and hindsight on public measurements of real training runs (issue #23).

For each traced job (imagenet: ResNet-50; cifar10: ResNet-18; bert: BERT on
SQuAD) and each cluster (Sia's default ``aws:6,dgx-ext:2,rtx:3``, the small mixed
``aws:2,rtx:1,azure:1`` and two more of three GPU types, ``aws:4,azure:1,rtx:2``
and ``azure:1,quad:2,aws:2``), runs every policy of ``jabascli.simulate`` and
prints, for ``jabas`` and ``jabas-similarity``:

- ``t/base``: time over the soonest baseline (``fixed-*``, ``ddp-all``, ``pollux``); target <= 1.00;
- ``t/oracle``: time over the hindsight oracle's; target <= 1.05;
- ``t/pollux``: time over pollux's; target on imagenet <= 0.80; where the oracle's own time over
  pollux's (``o/pollux``, printed per case) is above 0.80, no policy can reach it on that cluster
  and the verdict says ``unreachable`` with the oracle's ratio rather than a miss;
- ``c/base``: cost over the cheapest baseline that is no sooner (``-``: every baseline is slower);
- ``moves``: allocation changes (each a checkpoint-restart);

then, for jabas run with ``--objective time``, ``cost`` and ``no-dearer``, the
baselines both sooner and cheaper than it (the Pareto check: there must be none
with ``cost``). ``cpu_s`` is the CPU time of a case's three simulations (one per
objective, every policy in each; one core).

Two hard clusters follow as extra rows, where the imagenet target on pollux is
out of any policy's reach: ``dgx-ext:1,rtx:1,quad:2`` (one A100 node beside
slower types) and ``quad:2,rtx:2,aws:2``. Every verdict other than ``met``, and
every Pareto check that finds a baseline, gets its reason printed from the
measurements: for an unreachable pollux target, the oracle's time on pollux's
GPU type alone against pollux's (what adapting the GBS and the GPU count gains)
and what the other types save on top; otherwise jabas's allocations against the
baseline's.

    .venv/bin/python benchmarks/trace_sim.py [--traces DIR] [--json OUT] [--jobs imagenet,cifar10]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from jabascli.simulate import TraceResult, simulate_trace
from jabascli.simulate.loop import PolicyResult

# As the tests: ../shared/reference/sia-traces beside the repository, or JABAS_SIA_TRACES.
TRACES = Path(
    os.environ.get("JABAS_SIA_TRACES", Path(__file__).resolve().parents[2] / "shared" / "reference" / "sia-traces")
)
JOBS = ("imagenet", "cifar10", "bert")
CLUSTERS = ("aws:6,dgx-ext:2,rtx:3", "aws:2,rtx:1,azure:1", "aws:4,azure:1,rtx:2", "azure:1,quad:2,aws:2")
HARD = ("dgx-ext:1,rtx:1,quad:2", "quad:2,rtx:2,aws:2")
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


def path(policy: PolicyResult) -> str:
    """The allocations a policy ran, with the epoch each began (``rtx:1n,aws:1n -> rtx:2n@14``)."""
    steps: list[tuple[int, str]] = []
    for entry in policy.timeline:
        if not steps or steps[-1][1] != entry["allocation"]:
            steps.append((entry["epoch"], entry["allocation"]))
    return " -> ".join(a if k == 0 else f"{a}@{k}" for k, a in steps)


def unreachable_reason(traces: Path, job: str, cluster: str, result: TraceResult) -> str:
    """Why no policy reaches 0.80x pollux: the oracle on pollux's GPU type alone, and what the other types add."""
    pollux, oracle = result.get("pollux"), result.get("oracle")
    assert pollux is not None and oracle is not None
    gpu_type = pollux.details["gpu_type"]
    nodes = dict(part.split(":") for part in cluster.split(","))[gpu_type]
    alone = simulate_trace(traces / job, f"{gpu_type}:{nodes}", policies=["oracle"]).get("oracle")
    assert alone is not None
    need = 1 - 0.80 * pollux.time_s / alone.time_s
    return (
        f"the oracle takes {oracle.time_s:,.0f} s ({path(oracle)}) against pollux's {pollux.time_s:,.0f} s"
        f" ({path(pollux)}): {oracle.time_s / pollux.time_s:.3f}x. On pollux's {gpu_type} alone the oracle takes"
        f" {alone.time_s:,.0f} s ({alone.time_s / pollux.time_s:.3f}x pollux), and the other types save"
        f" {1 - oracle.time_s / alone.time_s:.1%} of that; 0.80x would need them to save {need:.1%}."
    )


def versus(result: TraceResult, name: str, others: list[str]) -> str:
    """jabas's run against the named baselines: time, cost and allocations, measured."""
    jabas = result.get("jabas")
    assert jabas is not None
    parts = [f"jabas {jabas.time_s:,.1f} s, {jabas.cost:.2f} $ on {path(jabas)}"]
    for other in others:
        p = result.get(other)
        assert p is not None
        where = p.details.get("allocation") or path(p)
        parts.append(f"{other} {p.time_s:,.1f} s, {p.cost:.2f} $ on {where}")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder holding imagenet/, cifar10/, bert/")
    parser.add_argument("--json", type=Path, default=None, help="also write every result (with timelines) here")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs (default: all three)")
    args = parser.parse_args()

    everything = []
    rows = []
    reasons: list[str] = []
    for job in args.jobs.split(","):
        for cluster in CLUSTERS + HARD:
            cpu = time.process_time()
            results = {"time": simulate_trace(args.traces / job, cluster)}
            for objective in OBJECTIVES[1:]:
                results[objective] = simulate_trace(args.traces / job, cluster, objective=objective)
            cpu = time.process_time() - cpu
            result = results["time"]
            beaten = {o: r.dominating() for o, r in results.items()}
            jabas = ratios(result, "jabas")
            rows.append((job, cluster, jabas, ratios(result, "jabas-similarity"), beaten, cpu))
            everything.extend(r.to_json() for r in results.values())
            case = f"{job} on {cluster}"
            said = verdict(job, jabas)
            if "unreachable" in said or "pollux" in said:
                reasons.append(f"{case}, pollux target: {unreachable_reason(args.traces, job, cluster, result)}")
            if "base" in said or "oracle" in said.split("(")[0]:
                soonest = min(
                    (p for p in result.policies if p.policy.startswith(("fixed", "ddp-all", "pollux"))),
                    key=lambda p: p.time_s,
                )
                reasons.append(f"{case}, {said}: {versus(result, 'jabas', [soonest.policy, 'oracle'])}")
            for objective, names in beaten.items():
                if names:
                    reasons.append(f"{case}, --objective {objective}: {versus(results[objective], 'jabas', names)}")

    def cells(r: dict[str, float | None]) -> str:
        c = "-" if r["c/base"] is None else f"{r['c/base']:.3f}"
        return (
            f"{r['t/base']:7.3f} {r['t/oracle']:8.3f} {r['t/pollux']:8.3f} {r['o/pollux']:8.3f} {c:>7}"
            f" {int(r['moves'] or 0):5d}"
        )

    def table_row(job: str, cluster: str, jabas: dict[str, float | None], similarity: dict[str, float | None]) -> str:
        said = verdict(job, jabas)
        return f"{job:<9} {cluster:<23} | jabas: {cells(jabas)} {said:<42} | similarity: {cells(similarity)}"

    head = f"{'t/base':>7} {'t/oracle':>8} {'t/pollux':>8} {'o/pollux':>8} {'c/base':>7} {'moves':>5}"
    title = f"{'job':<9} {'cluster':<23} | jabas: {head} {'targets':<42} | similarity: {head} | {'cpu_s':>5}"
    print("## jabas (goodput) and jabas-similarity against the best baseline and the oracle")
    print(title)
    for job, cluster, jabas, similarity, _, cpu in rows:
        if cluster in CLUSTERS:
            print(f"{table_row(job, cluster, jabas, similarity)} | {cpu:5.1f}")
    print("\n## Hard cases (extra rows): 0.80x pollux on imagenet out of any policy's reach")
    print(title)
    for job, cluster, jabas, similarity, _, cpu in rows:
        if cluster in HARD:
            print(f"{table_row(job, cluster, jabas, similarity)} | {cpu:5.1f}")
    print("\n## Pareto check: baselines both sooner and cheaper than jabas, per --objective (none is the target)")
    print((f"{'job':<9} {'cluster':<23} " + " ".join(f"{o:<22}" for o in OBJECTIVES)).rstrip())
    for job, cluster, _, _, beaten, _ in rows:
        pareto = " ".join(f"{','.join(beaten[o]) or 'none':<22}" for o in OBJECTIVES)
        print(f"{job:<9} {cluster:<23} {pareto}".rstrip())
    print("\n## Reasons, measured (every verdict but `met`, every baseline in the Pareto check)")
    for line in reasons or ["none: every case met every target, and no baseline is both sooner and cheaper"]:
        print(f"- {line}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
