"""jabas's own iteration against a plain DDP loop, on the same uneven split of the same GBS.

Where jabas trains the split uneven-batch DDP trains (``uneven_ddp.py``: one
micro-batch per server, each of its own size), any gap between the two is the
cost of jabas's iteration itself: its sampler, loss weighting, exact buffer
statistics, step log and control checks. This runs both on the workload of
``heterogeneous_efficiency.py`` with a fast server and an emulated slower one,
``--rounds`` times side by side (jabas then uneven DDP, then the other way
round), and prints each round's median iteration times and their ratio::

    .venv/bin/python benchmarks/same_split.py --workload vit --slowdown 1.5 --split 159,97

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from jabascli.solver.plan import Assignment, Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heterogeneous_efficiency import WORKLOADS, Bench
from uneven_ddp import UnevenSpec, median_after_warmup, train_uneven


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="vit", choices=sorted(WORKLOADS))
    parser.add_argument("--slowdown", type=float, default=1.5, help="the slow server's emulated slowdown")
    parser.add_argument("--split", default="159,97", help="the fast and the slow server's samples per iteration")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="iterations per run (the first 5 are left out)")
    args = parser.parse_args()
    fast, slow = (int(b) for b in args.split.split(","))
    workload, options = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory(prefix="jabas-same-split-") as folder:
        root = Path(folder)
        bench = Bench(root, args.workload, workload, options, args.slowdown, [fast + slow])
        assignments = (
            Assignment("fast", "cpu", 1, 1, 0, lbs=fast),
            Assignment(bench.slow, f"cpu-x{args.slowdown:g}", 1, 1, 0, lbs=slow),
        )
        plan = Plan(fast + slow, min(fast, slow), "sequential", None, None, assignments)
        spec = UnevenSpec(workload, options, (fast, slow), (1.0, args.slowdown), args.steps)
        jabas_s: list[float] = []
        ddp_s: list[float] = []
        for r in range(args.rounds):
            for which in ("jabas", "ddp") if r % 2 == 0 else ("ddp", "jabas"):
                if which == "jabas":
                    jabas_s.append(bench.train(plan, 0.0, quick=False, steps=args.steps).measured_s)
                else:
                    ddp_s.append(median_after_warmup(train_uneven(spec, root / f"uneven{r}")))
            print(
                f"round {r + 1}: jabas {jabas_s[-1] * 1e3:.1f} ms, uneven DDP {ddp_s[-1] * 1e3:.1f} ms, "
                f"jabas's speed over uneven DDP's {ddp_s[-1] / jabas_s[-1]:.3f}",
                flush=True,
            )
    ratio = statistics.fmean(ddp_s) / statistics.fmean(jabas_s)
    print(
        f"{args.workload} {fast}+{slow} at {args.slowdown:g}x: jabas {statistics.fmean(jabas_s) * 1e3:.1f} ms, "
        f"uneven DDP {statistics.fmean(ddp_s) * 1e3:.1f} ms per iteration (means of {args.rounds} rounds); "
        f"jabas's speed over uneven DDP's {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
