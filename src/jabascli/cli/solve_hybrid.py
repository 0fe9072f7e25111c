"""``jabas solve --hybrid``: the hybrid planner's plan for a GBS, or a table of plans over a GBS range."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from jabascli.atomic import atomic_write_json
from jabascli.cli.common import console, print_json
from jabascli.config import LoadedConfig
from jabascli.errors import InputError

if TYPE_CHECKING:
    from jabascli.hybrid.job import HybridJob
    from jabascli.hybrid.search import Choice


def solve_hybrid(
    loaded: LoadedConfig,
    gbs: int | None,
    gbs_range: tuple[int, int] | None,
    profiles: Path | None,
    model: str | None,
    tp: int | None,
    out: Path | None,
    json_out: bool,
) -> None:
    from jabascli.hybrid.job import load_job, model_name, profiles_root, solve, solve_range

    root = profiles_root(loaded, profiles)
    job = load_job(loaded, root, model_name(loaded, root, model), tp)
    if gbs is not None:
        choice = solve(job, gbs)
        document = plan_document(job, choice)
        if out is not None:
            atomic_write_json(out, document, indent=2)
        if json_out:
            print_json(document)
        else:
            print_hybrid(job, choice, out)
        return
    assert gbs_range is not None
    lo, hi = gbs_range
    choices = solve_range(job, lo, hi)
    if not choices:
        solve(job, lo)  # raises why the smallest GBS has no plan
    if json_out:
        print_json({"plans": [plan_document(job, c) for c in choices]})
    else:
        print_hybrid_range(choices, lo, hi)


def layout_name(choice: Choice) -> str:
    """``plain IIDP``, or ``2 stages x 8 replicas, TP 2, sharded, 3 blocks checkpointed``."""
    from jabascli.hybrid.job import is_plain

    plan = choice.plan
    if is_plain(plan):
        return "plain IIDP"
    tp = max(p.tp for r in plan.replicas for p in r.stages)
    parts = [f"{plan.num_stages} stage{'s' if plan.num_stages > 1 else ''} x {len(plan.replicas)} replicas"]
    parts.append(f"TP {tp}")
    if plan.sharding != "none":
        parts.append("optimizer sharded")
    if plan.checkpoint:
        parts.append(f"{len(plan.checkpoint)} blocks checkpointed")
    return ", ".join(parts)


def plan_document(job: HybridJob, choice: Choice) -> dict[str, Any]:
    """The plan file (the runtime reads ``parallel`` and the assignments) and what the model predicts."""
    from jabascli.hybrid.job import is_plain, plan_file

    pred = choice.prediction
    return {
        **plan_file(job, choice).to_dict(),
        "predicted": {
            "layout": "plain IIDP" if is_plain(choice.plan) else "hybrid",
            "plan": choice.plan.describe(),
            "pipeline_s": list(pred.pipeline_s),
            "sync_s": pred.sync_s,
            "update_s": pred.update_s,
            "peak_bytes": [list(row) for row in pred.peak_bytes],
        },
    }


def print_hybrid(job: HybridJob, choice: Choice, out: Path | None) -> None:
    from jabascli.hybrid.search import size

    plan, pred = choice.plan, choice.prediction
    stages = Table(title=f"Hybrid plan for GBS {plan.gbs}: stages")
    for column in ("stage", "blocks", "device type", "TP", "sharding", "checkpointed", "peak/device", "budget"):
        stages.add_column(column, justify="right" if column in ("stage", "TP", "peak/device", "budget") else "left")
    rows: dict[tuple[int, str, int], float] = {}
    for r, rep in enumerate(plan.replicas):
        for s, place in enumerate(rep.stages):
            key = (s, place.device, place.tp)
            rows[key] = max(rows.get(key, 0.0), pred.peak_bytes[r][s])
    for (s, device, tp), peak in sorted(rows.items()):
        first, last = plan.bounds[s], plan.bounds[s + 1] - 1
        ckpt = sorted(i for i in plan.checkpoint if first <= i <= last)
        budget = job.profiles.devices[device].memory_bytes
        stages.add_row(
            str(s),
            f"{first}-{last}",
            device,
            str(tp),
            plan.sharding,
            ",".join(map(str, ckpt)) or "-",
            size(peak),
            size(budget),
        )
    console.print(stages)
    replicas = Table(title="replicas")
    for column in ("replicas", "devices, stage by stage", "micro-batches each", "predicted s", "peak/device"):
        replicas.add_column(column, justify="left" if column.startswith("devices") else "right")
    groups: dict[tuple[str, int, float, float], int] = {}
    for r, rep in enumerate(plan.replicas):
        where = " > ".join(f"{p.device} x{p.tp}" for p in rep.stages)
        key = (where, rep.microbatches, round(pred.pipeline_s[r], 6), max(pred.peak_bytes[r]))
        groups[key] = groups.get(key, 0) + 1
    for (where, micro, time_s, peak), count in groups.items():
        replicas.add_row(str(count), where, str(micro), f"{time_s:.3f}", size(peak))
    console.print(replicas)
    micro = sum(r.microbatches for r in plan.replicas)
    console.print(
        f"GBS {plan.gbs} = LBS {plan.mbs} x {micro} micro-batches, {layout_name(choice)}: "
        f"{pred.iteration_s:.3f} s per iteration predicted (slowest pipeline {max(pred.pipeline_s):.3f} s + gradient "
        f"sync {pred.sync_s:.3f} s + update {pred.update_s:.3f} s), {plan.gbs / pred.iteration_s:.1f} samples/s",
        highlight=False,
    )
    if out is not None:
        console.print(f"plan written to {out}", highlight=False)


def print_hybrid_range(choices: list[Choice], lo: int, hi: int) -> None:
    from jabascli.hybrid.search import size

    table = Table(title=f"Hybrid plan per GBS in {lo}..{hi} ({len(choices)} with a plan)")
    for column in ("GBS", "LBS", "layout", "s/iteration", "samples/s", "peak/device"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for c in choices:
        t = c.prediction.iteration_s
        table.add_row(
            str(c.plan.gbs),
            str(c.plan.mbs),
            layout_name(c),
            f"{t:.3f}",
            f"{c.plan.gbs / t:.1f}",
            size(c.prediction.max_peak_bytes),
        )
    console.print(table)


def check_hybrid_options(hybrid: bool, **given: object) -> None:
    """Options that mean something only with --hybrid."""
    if hybrid:
        return
    for name, value in given.items():
        if value is not None:
            raise InputError.at(None, f"--{name}", "goes with --hybrid")
