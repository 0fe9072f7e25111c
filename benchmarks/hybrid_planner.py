"""The hybrid planner's cost model against real measurements, and its search against published plans.

``--sailor DIR``: import Sailor's profiles (eth-easl/sailor, MIT; ``../shared/reference/planners/sailor``), predict
every validation plan under DIR (``**/validation/**/plan_config_*.json``: plans that were run, with the iteration
time and peak memory measured) and print predicted vs measured per plan; the last line gives the median absolute
errors over the homogeneous (one device type) and the mixed plans separately. Before it, on each mixed cluster of
the validation plans (plans whose stages take whole servers, grouped by servers and GBS), jabas's searched plan
against the best measured Sailor plan, the best plan on one device type and the best even-split plan. First, the
planning speed on 48 blocks x 64 servers x 8 GPUs of 3 types: the search, `jabas solve --hybrid`'s path (one TP
degree for the job, plans the runtime can deal) and its `--range 256:32768` table, in CPU seconds.

    .venv/bin/python benchmarks/hybrid_planner.py --sailor ../shared/reference/planners/sailor
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.job import HybridJob, solve, solve_range
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.hybrid.search import ServerGroup, search
from jabascli.inputs import read_json
from jabascli.profiles.hybrid_import import (
    GALVATRON_DEVICE,
    import_galvatron,
    import_sailor,
    read_sailor_plan,
    with_layers,
)

GB = 1e9


Cluster = tuple[tuple[str, int], ...]


def whole_server_cluster(model: CostModel, plan: Plan) -> Cluster | None:
    """The servers a Sailor plan ran on, by device type, when each of its stage replicas took a whole server."""
    count: dict[str, int] = {}
    for rep in plan.replicas:
        for p in rep.stages:
            if p.tp != model.profiles.devices[p.device].devices_per_server:
                return None
            count[p.device] = count.get(p.device, 0) + 1
    return tuple(sorted(count.items()))


def compare_search(model: CostModel, cluster: Cluster, gbs: int, measured: list[tuple[str, float, float]]) -> None:
    servers = [ServerGroup(d, n) for d, n in cluster]
    found = search(model, servers, gbs)
    jabas = found.prediction.iteration_s
    name, real, pred = min(measured, key=lambda m: m[1])
    print(f"\ncluster {dict(cluster)} GBS {gbs}:")
    print(f"  jabas plan: {found.plan.describe()[:160]}")
    print(f"    predicted {jabas:.2f} s, peak {found.prediction.max_peak_bytes / GB:.1f} GB")
    print(f"  best measured Sailor plan {name}: measured {real:.2f} s (our model: {pred:.2f} s)")
    print(f"    ratio {real / jabas:.2f}x (target >= 1)")
    singles = []
    for d, n in cluster:
        try:
            singles.append((search(model, [ServerGroup(d, n)], gbs).prediction.iteration_s, d))
        except InputError as err:
            print(f"  only {d}: no plan fits ({err})")
    if singles:
        t, d = min(singles)
        print(f"  best single-type plan (only {d}): {t:.2f} s; ratio {t / jabas:.2f}x (target >= 1.3x)")
    even = search(model, servers, gbs, even_split=True)
    print(f"  best even-split plan: {even.prediction.iteration_s:.2f} s ({even.plan.describe()[:90]})")
    print(f"    ratio {even.prediction.iteration_s / jabas:.2f}x (target > 1)")


def validate_sailor(root: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    profiles = import_sailor(root)
    groups: dict[tuple[str, Cluster, int], list[tuple[str, float, float]]] = {}
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
        cluster = whole_server_cluster(models[model], plan)
        if group == "mixed" and cluster is not None:
            groups.setdefault((model, cluster, plan.gbs), []).append((path.name, real_s, pred.iteration_s))
        err[group][0].append(abs(t_err))
        err[group][1].append(abs(m_err))
        name = str(path.relative_to(root))[-58:]
        print(
            f"{name:58s} {model:12s} {pred.iteration_s:8.2f} {real_s:8.2f} {t_err:+6.0%} "
            f"{pred.max_peak_bytes / GB:8.2f} {real_mem / GB:8.2f} {m_err:+6.0%}  {group}"
        )
    for (model, cluster, gbs), measured in groups.items():
        compare_search(models[model], cluster, gbs, measured)
    return err["homo"][0], err["homo"][1], err["mixed"][0], err["mixed"][1]


def planning_speed(root: Path) -> None:
    """48 blocks (OPT-350M's embedding, 46 of its layers, its head) on 64 servers x 8 GPUs of three types."""
    model = CostModel(with_layers(import_sailor(root)["OPT-350"], 46))
    servers = [ServerGroup("RTX-3090", 21), ServerGroup("Titan-RTX", 21), ServerGroup("RTX-2080", 22)]
    start = time.process_time()
    found = search(model, servers, 4096)
    took = time.process_time() - start
    print(f"\nplanning 48 blocks on 64 servers x 8 GPUs of 3 types, GBS 4096: {took:.2f} s CPU (target <= 10 s)")
    print(f"  {found.plan.describe()[:150]}: predicted {found.prediction.iteration_s:.2f} s")
    # What `jabas solve --hybrid` runs: one TP degree for the whole job (the runtime's [parallel] tp), each searched.
    names = {g.device: [f"{g.device}-{k}" for k in range(g.count)] for g in servers}
    job = HybridJob(model.profiles, servers, names, root)
    start = time.process_time()
    chosen = solve(job, 4096)
    took = time.process_time() - start
    print(
        f"`jabas solve --hybrid --gbs 4096` (one TP degree per plan, each searched): {took:.2f} s CPU (target <= 10 s)"
    )
    print(f"  {chosen.plan.describe()[:150]}: predicted {chosen.prediction.iteration_s:.2f} s")
    job = HybridJob(model.profiles, servers, names, root)  # nothing cached from the single GBS
    start = time.process_time()
    table = solve_range(job, 256, 32768)
    took = time.process_time() - start
    print(f"`jabas solve --hybrid --range 256:32768` ({len(table)} GBS values): {took:.2f} s CPU (target <= 60 s)")
    for c in table:
        print(f"  GBS {c.plan.gbs:6d}: {c.prediction.iteration_s:7.2f} s  {c.plan.describe()[:110]}")


STRATEGY = re.compile(
    r"galvatron_config_(?P<name>.+)_(?P<nodes>\d+)nodes_(?P<gpus>\d+)gpus_per_node_(?P<gb>\d+)GB_bf16"
)


def galvatron_plan(strategy: dict[str, object], gpus: int, n_layers: int) -> tuple[Plan, str]:
    """Galvatron's searched strategy as a jabas plan, and what had to be approximated."""
    notes = []
    tps = {int(t) for t in str(strategy["tp_sizes_enc"]).split(",")}
    tp = max(tps)
    if len(tps) > 1:
        notes.append(f"per-layer TP {sorted(tps)} priced at {tp}")
    pp = int(str(strategy["pp_deg"]))
    dp = gpus // (pp * tp)
    chunks = int(str(strategy["chunks"]))
    gbs = int(str(strategy["global_bsz"]))
    mbs = -(-gbs // (dp * chunks))
    if mbs * dp * chunks != gbs:
        notes.append(f"micro-batch {gbs}/({dp}x{chunks}) rounded up to {mbs}")
    sizes = [int(x) for x in str(strategy["pp_division"]).split(",")]
    bounds = [0]
    for k, size in enumerate(sizes):  # the embedding goes with the first stage, the head with the last
        bounds.append(bounds[-1] + size + (1 if k == 0 else 0) + (1 if k == len(sizes) - 1 else 0))
    ckpt = frozenset(1 + i for i, c in enumerate(str(strategy.get("checkpoint", "0")).split(",")) if c == "1")
    if len(str(strategy.get("checkpoint", "0")).split(",")) == 1 and ckpt:
        ckpt = frozenset(range(1, n_layers + 1))
    sharded = "1" in str(strategy.get("dp_types_enc", "0")).split(",")
    if sharded:
        notes.append("ZeRO-3 layers priced as optimizer-state sharding")
    if strategy.get("default_dp_type") == "zero2" and dp > 1:
        notes.append("ZeRO-2 default (gradients sharded too) priced without gradient sharding")
    reps = tuple(Replica(tuple(Placement(GALVATRON_DEVICE, tp, "node0") for _ in range(pp)), chunks) for _ in range(dp))
    plan = Plan(mbs, tuple(bounds), reps, ckpt, "full" if sharded else "none")
    return plan, "; ".join(notes)


def memory_parts(model: CostModel, plan: Plan) -> str:
    """What fills the first stage's devices (where 1F1B keeps the most micro-batches)."""
    place = plan.replicas[0].stages[0]
    first, last = plan.bounds[0], plan.bounds[1]
    w = model.params(first, last, place.tp)
    k_o = model.blocks.optimizer_bytes_per_param_byte / (len(plan.replicas) if plan.sharding == "full" else 1)
    ckpt = frozenset(i for i in plan.checkpoint if first <= i < last)
    in_flight = min(plan.replicas[0].microbatches, plan.num_stages)
    kept, recompute = model.activations(plan.mbs, place.tp, first, last, ckpt)
    act = in_flight * kept + recompute
    return (
        f"parameters+gradients {w * 2 / GB:.1f} GB, optimizer {w * k_o / GB:.1f} GB, "
        f"activations {act / GB:.1f} GB ({in_flight} micro-batches of {plan.mbs}, one block recomputed)"
    )


def compare_galvatron(root: Path) -> None:
    """Each searched strategy under ``root`` whose model has one layer type, against jabas's search."""
    profiles = import_galvatron(root)
    print("\nGalvatron's searched strategies (PKU-DAIR/Hetu-Galvatron, Apache-2.0) against jabas, same model:")
    for path in sorted(root.rglob("galvatron_config_*.json")):
        match = STRATEGY.match(path.stem)
        if match is None or "example" in path.stem:
            continue
        folder = path.parent.parent.name
        names = [k for k in profiles if k.startswith(f"{folder}/{match['name']}")]
        if not names:
            print(f"  {path.name}: no converted profile for {folder}/{match['name']} (several layer types)")
            continue
        strategy = read_json(path)
        n_layers = len(str(strategy["tp_sizes_enc"]).split(","))
        nodes, gpus = int(match["nodes"]), int(match["gpus"])
        budget = int(match["gb"]) * 2**30
        base = with_layers(profiles[names[0]], n_layers)
        theirs, notes = galvatron_plan(strategy, nodes * gpus, n_layers)
        dev = base.devices[GALVATRON_DEVICE]
        # Galvatron's times are linear in the micro-batch size: its own micro-batch, scaled from 1 sample
        times = {
            **dev.times,
            theirs.mbs: {t: [tuple(x * theirs.mbs for x in r) for r in rows] for t, rows in dev.times[1].items()},
        }
        dev = dev.model_copy(update={"memory_bytes": budget, "devices_per_server": gpus, "times": times})
        model = CostModel(base.model_copy(update={"devices": {GALVATRON_DEVICE: dev}}))
        pred = model.predict(theirs)
        print(f"  {folder}/{path.name[:60]}  {nodes * gpus} GPUs, {match['gb']} GB, GBS {theirs.gbs}")
        verdict = "fits" if pred.fits else f"does NOT fit: {pred.max_peak_bytes / budget:.2f}x the budget"
        print(f"    Galvatron: {theirs.describe()[:100]}")
        print(f"      predicted {pred.iteration_s:.3f} s, peak {pred.max_peak_bytes / GB:.1f} GB, {verdict}")
        if not pred.fits:
            print(f"      why: {memory_parts(model, theirs)}")
        if notes:
            print(f"      approximated: {notes}")
        try:
            ours = search(model, [ServerGroup(GALVATRON_DEVICE, nodes)], int(str(strategy["global_bsz"])))
        except InputError as err:
            print(f"    jabas: {err}")
            continue
        jp = ours.prediction
        ratio = pred.iteration_s / jp.iteration_s
        print(f"    jabas:     {ours.plan.describe()[:100]}")
        peak = jp.max_peak_bytes / GB
        print(f"      predicted {jp.iteration_s:.3f} s, peak {peak:.1f} GB; Galvatron/jabas {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sailor", type=Path, help="Sailor reference folder (profiles and validation plans)")
    parser.add_argument("--galvatron", type=Path, help="a Galvatron folder (profiles, hardware, searched strategies)")
    args = parser.parse_args()
    if args.galvatron:
        compare_galvatron(args.galvatron)
    if args.sailor:
        planning_speed(args.sailor)
        ht, hm, mt, mm = validate_sailor(args.sailor)
        med = statistics.median
        print(
            f"median |error| homogeneous ({len(ht)} plans): time {med(ht):.1%} memory {med(hm):.1%}; "
            f"mixed ({len(mt)} plans): time {med(mt):.1%} memory {med(mm):.1%}"
        )


if __name__ == "__main__":
    main()
