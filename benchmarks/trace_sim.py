"""jabas against its baselines on public measurements of real training runs (issue #16).

For each traced job (imagenet: ResNet-50; cifar10: ResNet-18; bert: BERT on
SQuAD) and each cluster (Sia's default ``aws:6,dgx-ext:2,rtx:3`` and a smaller
mixed ``aws:2,rtx:1,azure:1``), runs every policy of ``jabascli.simulate`` and
prints completion time, cost, GPU-hours and moves, then jabas's ratios against
the best baseline (the soonest and the cheapest of fixed-*, ddp-all, pollux).

Targets (issue #16): jabas at least 15% sooner than the soonest baseline
(time ratio <= 0.85) and no dearer than the cheapest (cost ratio <= 1.00).
jabas runs with its planner's default objective (``time``); the row
``jabas:no-dearer`` is the same policy with ``--objective no-dearer`` (other types
only where they do not make the job dearer than the fastest single type). The
last column of the summary is the CPU time of that whole simulation (every
policy, one core): it must be seconds.

    .venv/bin/python benchmarks/trace_sim.py [--traces DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jabascli.simulate import simulate_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "reference" / "sia-traces"
JOBS = ("imagenet", "cifar10", "bert")
CLUSTERS = ("aws:6,dgx-ext:2,rtx:3", "aws:2,rtx:1,azure:1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder holding imagenet/, cifar10/, bert/")
    parser.add_argument("--json", type=Path, default=None, help="also write every result (with timelines) here")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs (default: all three)")
    args = parser.parse_args()

    everything = []
    summary = []
    for job in args.jobs.split(","):
        for cluster in CLUSTERS:
            start, cpu = time.perf_counter(), time.process_time()
            result = simulate_trace(args.traces / job, cluster)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            no_dearer = simulate_trace(args.traces / job, cluster, ["jabas"], objective="no-dearer").policies[0]
            no_dearer.policy = "jabas:no-dearer"
            result.policies.insert(result.policies.index(result.get("jabas")) + 1, no_dearer)
            print(f"\n## {job} on {cluster}  (simulated in {wall:.1f} s wall, {cpu:.1f} s CPU)")
            print(f"{'policy':<16} {'time_h':>8} {'cost_$':>9} {'gpu_h':>8} {'moves':>5}  setting")
            for p in result.policies:
                setting = p.details.get("allocation") or p.details.get("gpu_type") or ""
                if p.policy == "ddp-all":
                    setting = f"GBS {p.details['batch_size']}"
                elif p.policy.startswith(("jabas", "oracle")):
                    changes = [
                        e["allocation"]
                        for i, e in enumerate(p.timeline)
                        if i == 0 or e["allocation"] != p.timeline[i - 1]["allocation"]
                    ]
                    setting = " -> ".join(changes[:4]) + (" -> ..." if len(changes) > 4 else "")
                print(f"{p.policy:<16} {p.time_s / 3600:8.3f} {p.cost:9.2f} {p.gpu_hours:8.2f} {p.moves:5d}  {setting}")
            cmp = result.comparison()
            assert cmp is not None
            relative = result.relative()
            met_time = cmp["time_ratio"] <= 0.85
            met_cost = cmp["cost_ratio_vs_cheapest"] <= 1.0
            print(
                f"jabas/{cmp['fastest_baseline']} time ratio={cmp['time_ratio']:.3f}"
                f" ({'met' if met_time else 'MISSED'} <= 0.85); "
                f"cost ratio vs soonest={cmp['cost_ratio_vs_fastest']:.3f}, "
                f"vs cheapest ({cmp['cheapest_baseline']})={cmp['cost_ratio_vs_cheapest']:.3f}"
                f" ({'met' if met_cost else 'MISSED'} <= 1.00)"
            )
            print(
                f"jabas:no-dearer time ratio={relative['jabas:no-dearer'][0]:.3f}, "
                f"cost ratio vs cheapest={relative['jabas:no-dearer'][1]:.3f}"
            )
            summary.append((job, cluster, cmp, relative["jabas:no-dearer"], cpu))
            everything.append(result.to_json())
    print("\n## summary: jabas against the best baseline")
    print(
        f"{'job':<9} {'cluster':<22} {'time':>6} {'cost/soonest':>13} {'cost/cheapest':>14}"
        f" {'no-dearer time':>15} {'cost/cheapest':>14} {'cpu_s':>6}"
    )
    for job, cluster, cmp, (nd_time, nd_cost), cpu in summary:
        print(
            f"{job:<9} {cluster:<22} {cmp['time_ratio']:6.3f} {cmp['cost_ratio_vs_fastest']:13.3f}"
            f" {cmp['cost_ratio_vs_cheapest']:14.3f} {nd_time:15.3f} {nd_cost:14.3f} {cpu:6.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
