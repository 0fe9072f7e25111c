"""How long the auto-scaler's decision takes for a hybrid job, priced by the hybrid planner (issue 21).

A 48-block model (Sailor's OPT-350M profiles: embedding, 46 layers, head; eth-easl/sailor, MIT, in
``../shared/reference/planners/sailor``) on a 3-type cluster (``--servers`` servers of each of RTX-3090, Titan-RTX
and RTX-2080, their devices per server as profiled), allocated in whole servers. Prints the CPU seconds of the first
decision (the allocations the planner's search prices, each by a hybrid search), of the same decision again (all cached)
and of the next epoch's decision at a doubled GBS, with the searches run and the allocation chosen; then checks
the cost model's lower bound against every allocation's time (which searches the allocations not yet priced).

    .venv/bin/python benchmarks/autoscale_hybrid.py --sailor ../shared/reference/planners/sailor
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jabascli.autoscale.allocation import AllocationSpace
from jabascli.autoscale.hybridcost import HybridCostModel
from jabascli.autoscale.planner import Objective, Planner
from jabascli.autoscale.trajectory import Segment
from jabascli.hybrid.job import HybridJob
from jabascli.perfmodel import ServerSpec
from jabascli.profiles.hybrid_import import import_sailor, with_layers

TYPES = {"RTX-3090": 1.5, "Titan-RTX": 1.2, "RTX-2080": 0.6}
"""The device types and a made-up price per GPU-hour of each (the objective 'cost' needs one)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sailor", type=Path, default=Path("../shared/reference/planners/sailor"))
    parser.add_argument("--servers", type=int, default=4, help="servers of each type")
    parser.add_argument("--gbs", type=int, default=256)
    args = parser.parse_args()
    profiles = with_layers(import_sailor(args.sailor)["OPT-350"], 46)
    specs = []
    for device in TYPES:
        per_server = profiles.devices[device].devices_per_server
        for k in range(args.servers):
            specs.append(ServerSpec(f"{device}-{k}", device, per_server, device, 100e9, 12.5e9))
    unit = min(s.devices for s in specs)
    space = AllocationSpace(specs, unit, {s.name: TYPES[s.device_type] for s in specs})
    model = HybridCostModel(HybridJob(profiles, [], {}, args.sailor), space)
    print(
        f"{profiles.num_blocks} blocks on {len(specs)} servers of 3 types "
        f"({', '.join(f'{s.name}: {s.devices}' for s in specs[:: args.servers])} devices); "
        f"{space.count()} allocations"
    )
    for kind in ("time", "cost"):
        planner = Planner(space, model, Objective(kind=kind))
        for label, gbs in (("first decision", args.gbs), ("the same again", args.gbs), ("GBS doubled", 2 * args.gbs)):
            searches = model.searches
            start = time.process_time()
            decision = planner.plan([Segment(gbs, 1000)])
            took = time.process_time() - start
            priced = model.priced(decision.choice, gbs)
            print(
                f"objective {kind}, {label} (GBS {gbs}): {took:.2f} s CPU, {model.searches - searches} searches; "
                f"chose {space.describe(decision.choice)}: {priced.time_s:.3f} s/iteration by {priced.by}"
            )
    # The planner prunes by the lower bound: check it against every time priced above.
    priced_all = [(c, g, model.iteration_time(c, g)) for c in space for g in (args.gbs, 2 * args.gbs)]
    over = [
        (c, g)
        for c, g, t in priced_all
        if g * model.sample_work(frozenset(s.device_type for s in space.specs(c))) / space.gpus(c) > t
    ]
    print(f"lower bound above the priced time: {len(over)} of {len(priced_all)} (must be 0)")


if __name__ == "__main__":
    main()
