"""The hybrid planner's cost model against real measurements, and its search against published plans.

``--sailor DIR``: import Sailor's profiles (eth-easl/sailor, MIT; ``../shared/reference/planners/sailor``), predict
every validation plan under DIR (``**/validation/**/plan_config_*.json``: plans that were run, with the iteration
time and peak memory measured) and print predicted vs measured per plan; the last line gives the median absolute
errors over the homogeneous (one device type) and the mixed plans separately.

    .venv/bin/python benchmarks/hybrid_planner.py --sailor ../shared/reference/planners/sailor
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.importers import import_sailor, read_sailor_plan

GB = 1e9


def validate_sailor(root: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    profiles = import_sailor(root)
    models = {name: CostModel(p) for name, p in profiles.items()}
    counts = {name: p.num_blocks for name, p in profiles.items()}
    err: dict[str, tuple[list[float], list[float]]] = {"homo": ([], []), "mixed": ([], [])}
    head = ["pred s", "meas s", "err", "pred GB", "meas GB", "err"]
    print(f"{'plan':58s} {'model':12s} " + " ".join(f"{h:>8s}" for h in head))
    for path in sorted(root.rglob("plan_config_*.json")):
        if "validation" not in path.parts:
            continue
        model, plan, real_s, real_mem = read_sailor_plan(path, counts)
        pred = models[model].predict(plan)
        t_err = (pred.iteration_s - real_s) / real_s
        m_err = (pred.max_peak_bytes - real_mem) / real_mem
        kinds = {p.device for r in plan.replicas for p in r.stages}
        group = "homo" if len(kinds) == 1 else "mixed"
        err[group][0].append(abs(t_err))
        err[group][1].append(abs(m_err))
        name = str(path.relative_to(root))[-58:]
        print(
            f"{name:58s} {model:12s} {pred.iteration_s:8.2f} {real_s:8.2f} {t_err:+6.0%} "
            f"{pred.max_peak_bytes / GB:8.2f} {real_mem / GB:8.2f} {m_err:+6.0%}  {group}"
        )
    return err["homo"][0], err["homo"][1], err["mixed"][0], err["mixed"][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sailor", type=Path, help="Sailor reference folder (profiles and validation plans)")
    args = parser.parse_args()
    if args.sailor:
        ht, hm, mt, mm = validate_sailor(args.sailor)
        med = statistics.median
        print(
            f"median |error| homogeneous ({len(ht)} plans): time {med(ht):.1%} memory {med(hm):.1%}; "
            f"mixed ({len(mt)} plans): time {med(mt):.1%} memory {med(mm):.1%}"
        )


if __name__ == "__main__":
    main()
