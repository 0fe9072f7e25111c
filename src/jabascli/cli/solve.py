"""``jabas solve``: the fastest configuration for a global batch size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, plural, print_json
from jabascli.cli.solve_hybrid import check_hybrid_options, solve_hybrid
from jabascli.config import LoadedConfig, load_config
from jabascli.errors import InputError, Problem

if TYPE_CHECKING:
    from jabascli.solver import Plan
    from jabascli.solver.choice import ServerChoice


@cli_command
def solve(
    config: ConfigOption,
    gbs: Annotated[int | None, typer.Option(help="Global batch size to solve for.")] = None,
    range_: Annotated[
        str | None,
        typer.Option(
            "--range", help="LO:HI: the best plan for every feasible GBS (--hybrid: LO, 2 LO, 4 LO ... and HI)."
        ),
    ] = None,
    servers: Annotated[
        str | None,
        typer.Option(help="auto (default: leave out any server that slows the job), all, or a list: node0,node1."),
    ] = None,
    weight_sync: Annotated[
        str | None, typer.Option(help="recommend, sequential or overlap (default: \\[job] weight_sync).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the plan for `jabas train` to this file.")] = None,
    kind: Annotated[
        str,
        typer.Option(
            help="best (default), iidp (equal micro-batches) or uneven (one micro-batch per GPU, sized to its "
            "speed; a fixed GBS without \\[parallel] only)."
        ),
    ] = "best",
    json_out: JsonOption = False,
    hybrid: Annotated[
        bool,
        typer.Option(
            "--hybrid",
            help="Plan data, sharded, tensor and pipeline parallelism from the hybrid profiles "
            "(docs/hybrid-planner.md), e.g. jabas solve -c jabas.toml --hybrid --gbs 256.",
        ),
    ] = False,
    profiles: Annotated[
        Path | None, typer.Option(help="With --hybrid: the profiles folder holding hybrid/ (default: the config's).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="With --hybrid: the model under hybrid/ (default: the only one, or the job's).")
    ] = None,
    tp: Annotated[
        int | None, typer.Option(help="With --hybrid: plan with this TP degree only (default: searched).")
    ] = None,
) -> None:
    """Best LBS, weight sync and (VSW, GA) per device for a global batch size.

    The plan is the fastest under the performance model (exactly, not a
    heuristic). With --servers auto (the default) the solver also picks how
    many GPUs of each kind of server to use, and says which servers it left
    out and what they would cost; --servers all uses every GPU of every server.
    For a fixed GBS without a \\[parallel] layout it also builds an uneven plan
    (each GPU one micro-batch of its own size, docs/performance-model.md) and
    takes it where it is predicted faster; the other one is shown below the
    plan, and --kind iidp or --kind uneven asks for one of them.

    Example:

        jabas solve -c quickstart/config.json --gbs 512

        jabas solve -c jabas.toml --gbs 128 --servers all --out plan.json

        jabas solve -c jabas.toml --range 256:8192 --json

    With --hybrid, the hybrid planner: pipeline stages, blocks per stage, TP
    degree, sharding and checkpointing, and each replica's micro-batches, from
    the profiles under <profiles>/hybrid/ (`jabas profile hybrid` or
    `jabas profile import`); --range LO:HI plans LO, 2 LO, 4 LO ... and HI.

        jabas solve -c jabas.toml --hybrid --gbs 256 --out plan.json

        jabas solve -c jabas.toml --hybrid --profiles imported/ --model OPT-350 --range 256:32768
    """
    if (gbs is None) == (range_ is None):
        raise InputError.at(None, "--gbs", "give exactly one of --gbs N and --range LO:HI")
    if range_ is not None and out is not None:
        raise InputError.at(None, "--out", "writes one plan: use it with --gbs, not --range")
    if tp is not None and tp < 1:
        raise InputError.at(None, "--tp", f"expected a TP degree >= 1, got {tp}")
    check_hybrid_options(hybrid, profiles=profiles, model=model, tp=tp)
    if hybrid:
        for name, value in (("servers", servers), ("weight-sync", weight_sync)):
            if value is not None:
                raise InputError.at(
                    None,
                    f"--{name}",
                    "not used with --hybrid: the hybrid search picks the servers, and has no weight-sync choice",
                )
        gbs_range = parse_range(range_) if range_ is not None else None
        loaded = load_config(config, check_profiles=False)
        solve_hybrid(loaded, gbs, gbs_range, profiles, model, tp, out, json_out)
        return
    from jabascli.solver import write_plan  # numpy: only when solving
    from jabascli.solver.choice import choose_plan, solver_for

    loaded = load_config(config)
    if kind not in KINDS:
        raise InputError.at(None, "--kind", f"expected {', '.join(KINDS)}, got {kind!r}")
    if gbs is not None:
        choice = choose_plan(loaded, gbs, servers, weight_sync, uneven=False if kind == "iidp" else None)
        plan = _of_kind(loaded, choice, kind)
        if out is not None:
            write_plan(out, plan)
        if json_out:
            print_json(plan.to_dict())
        else:
            print_plan(plan, out)
            other = choice.alternative if plan is choice.plan else choice.plan
            if other is not None:
                name, flag = ("uneven", "uneven") if other.uneven else ("IIDP", "iidp")
                console.print(
                    f"{name} alternative: LBS {other.lbs_text()}, {_ms(other)} per iteration (--kind {flag})",
                    highlight=False,
                )
            if choice.line() and plan is choice.plan:
                console.print(f"{choice.line()} (--servers all keeps every server)", highlight=False)
            _refit_line(loaded)
        return
    if kind != "best":
        raise InputError.at(None, "--kind", "chooses the plan for one GBS: use it with --gbs, not --range")
    solver = solver_for(loaded, servers, weight_sync)
    lo, hi = parse_range(range_ or "")
    plans = solver.solve_range(lo, hi)
    if not plans:
        first = solver.unreachable(lo)[0].message.replace(f"GBS {lo}", f"any GBS in {lo}..{hi}")
        raise InputError.at(None, "--range", first)
    if json_out:
        print_json({"plans": [p.to_dict() for p in plans]})
    else:
        print_range(plans, lo, hi)
        _refit_line(loaded)


KINDS = ("best", "iidp", "uneven")


def _ms(plan: Plan) -> str:
    return f"{(plan.iteration_time_s or 0.0) * 1e3:.1f} ms"


def _of_kind(loaded: LoadedConfig, choice: ServerChoice, kind: str) -> Plan:
    """The plan ``--kind`` asks for: the best, or the best IIDP or uneven one."""
    from jabascli.solver.choice import uneven_offered

    if kind != "uneven" or choice.plan.uneven:
        return choice.plan
    if choice.alternative is not None and choice.alternative.uneven:
        return choice.alternative
    if not uneven_offered(loaded):
        why = "an uneven plan trains a fixed GBS ([batching] metric = fixed) without a [parallel] layout"
    else:
        why = f"no uneven plan reaches GBS {choice.plan.gbs} (the balanced split is even, or below the profiled LBS)"
    raise InputError.at(None, "--kind", why)


def _refit_line(loaded: LoadedConfig) -> None:
    """Say when the predictions are the job's refit model's, not the profiles' alone."""
    from jabascli.solver.online import job_refit

    in_use = job_refit(loaded)
    if in_use is not None:
        console.print(in_use.line(), highlight=False, markup=False)


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        low, high = int(lo), int(hi)
    except ValueError:
        raise InputError([Problem(None, "--range", f"expected LO:HI with two integers, got {text!r}")]) from None
    if low <= 0 or high < low:
        raise InputError.at(None, "--range", f"expected 0 < LO <= HI, got {text!r}")
    return low, high


def print_plan(plan: Plan, out: Path | None) -> None:
    table = Table(title=f"Plan for GBS {plan.gbs}")
    for column in ("server", "device type", "GPUs", "LBS", "VSW", "GA", "workers", "predicted ms/iteration"):
        table.add_column(column, justify="left" if column in ("server", "device type") else "right")
    for a in plan.assignments:
        ms = f"{a.iteration_time_s * 1e3:.1f}" if a.iteration_time_s is not None else "-"
        lbs = str(a.lbs or plan.lbs)
        table.add_row(a.server, a.device_type, str(a.gpus), lbs, str(a.vsw), str(a.ga), str(a.workers), ms)
    console.print(table)
    split = (
        f"LBS {plan.lbs_text()} ({plural(plan.workers, 'micro-batch', 'micro-batches')} of their GPUs' own sizes)"
        if plan.uneven
        else f"LBS {plan.lbs} x {plural(plan.workers, 'worker')}"
    )
    console.print(
        f"GBS {plan.gbs} = {split} on {plural(plan.gpus, 'GPU')}, "
        f"weight sync {plan.weight_sync}: {plan.iteration_time_s * 1e3:.1f} ms per iteration, "
        f"{plan.throughput:.1f} samples/s",
        highlight=False,
    )
    console.print(plan.seed_form(), highlight=False)
    if out is not None:
        console.print(f"plan written to {out}", highlight=False)


def print_range(plans: list[Plan], lo: int, hi: int) -> None:
    table = Table(title=f"Best plan per GBS in {lo}..{hi} ({len(plans)} feasible)")
    for column in ("GBS", "LBS", "weight sync", "GPUs", "ms/iteration", "samples/s"):
        table.add_column(column, justify="left" if column == "weight sync" else "right")
    table.add_column("configuration", overflow="fold")
    for p in plans:
        table.add_row(
            str(p.gbs),
            p.lbs_text(),
            p.weight_sync,
            str(p.gpus),
            f"{p.iteration_time_s * 1e3:.1f}",
            f"{p.throughput:.1f}",
            p.seed_form(),
        )
    console.print(table)
