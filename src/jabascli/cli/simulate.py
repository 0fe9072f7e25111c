"""``jabas simulate``: a whole training run under each allocation policy, without training.

Two modes, each a thin call into its library:

- ``-c FILE --trajectory SPEC`` (:mod:`jabascli.autoscale.simulate`): the configured
  cluster's profiles, along a given GBS trajectory;
- ``--trace DIR --cluster TYPE:NODES,...`` (:mod:`jabascli.simulate`): public
  measurements of real runs on six GPU types, with the GBS chosen by each policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from jabascli.cli.common import JsonOption, cli_command, console, err_console, print_json
from jabascli.config import load_config
from jabascli.errors import InputError

TRACE_OPTIONS = ("--cluster", "--policies", "--prices", "--target-metric", "--objective")
TRAJECTORY_OPTIONS = ("--config", "--trajectory", "--epochs", "--dataset-size")


@cli_command
def simulate(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Job config (jabas.toml or the seed's config.json); not with --trace.",
            show_default=False,
        ),
    ] = None,
    trajectory: Annotated[
        str | None,
        typer.Option(
            help="The GBS over the run: a run folder (its steps.csv), a CSV of step,gbs, "
            "grow:LO:HI, shrink:HI:LO or flat:G. Needs -c.",
            show_default=False,
        ),
    ] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs to simulate (default: \\[job] epochs).")] = None,
    dataset_size: Annotated[
        int | None, typer.Option(help="Samples per epoch (default: the workload's training set).")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="A trace folder of real runs (Sia/Pollux format), e.g. ../shared/reference/sia-traces/imagenet.",
            show_default=False,
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="With --trace: nodes per GPU type, e.g. aws:6,dgx-ext:2,rtx:3.", show_default=False),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help="With --trace: policies to run, comma-separated, e.g. fixed-256,pollux,jabas "
            "(default: fixed,ddp-all,pollux,jabas,jabas-similarity,oracle; fixed = every traced GBS).",
            show_default=False,
        ),
    ] = None,
    prices: Annotated[
        str | None,
        typer.Option(help="With --trace: $ per GPU-hour overrides, e.g. rtx=1.2,aws=0.9.", show_default=False),
    ] = None,
    target_metric: Annotated[
        float | None,
        typer.Option(
            help="With --trace: end the job when the traced validation metric reaches this, and plan "
            "to it, e.g. 0.75 (default: at the trace's end).",
            show_default=False,
        ),
    ] = None,
    objective: Annotated[
        str | None,
        typer.Option(
            help="With --trace: jabas's planner objective, time (the fastest allocation), cost (the cheapest) "
            "or no-dearer (the fastest among those no dearer than the fastest single-type one), "
            "e.g. --objective cost (default: time).",
            show_default=False,
        ),
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Simulate a training run under each policy, without training.

    With -c and --trajectory: the configured cluster under the policies all,
    best-fixed, jabas and oracle. Iteration times come from the profiles through
    the performance model and the solver; the GBS changes every \\[batching]
    adjust_interval iterations along the trajectory.

    With --trace and --cluster: a traced job (step times and gradient statistics
    of real runs, docs/simulation.md) on a cluster of traced GPU types under the
    policies fixed-<B>, ddp-all, pollux, jabas, jabas-similarity and oracle, each
    choosing its own GBS and allocation; ratios are to the fastest and the
    cheapest baseline (fixed-*, ddp-all, pollux).

    Prints completion time, cost, GPU-hours and moves per policy (--json:
    {"policies": [{"policy", "time_s", "cost", "gpu_hours", "moves", ...}], ...},
    what `jabas report` plots).

    Example:

        jabas simulate -c quickstart/config.json --trajectory grow:256:8192 --epochs 30 --dataset-size 1281167

        jabas simulate -c jabas.toml --trajectory runs/job --json > sim.json

        jabas simulate --trace ../shared/reference/sia-traces/imagenet --cluster aws:6,dgx-ext:2,rtx:3

        jabas simulate --trace ../shared/reference/sia-traces/cifar10 --cluster aws:2,rtx:1 --json > sim.json
    """
    trace_given = {
        "--cluster": cluster,
        "--policies": policies,
        "--prices": prices,
        "--target-metric": target_metric,
        "--objective": objective,
    }
    trajectory_given = {
        "--config": config,
        "--trajectory": trajectory,
        "--epochs": epochs,
        "--dataset-size": dataset_size,
    }
    if trace is not None:
        _refuse(
            trajectory_given,
            "with --trace (a trace simulation takes --cluster, --policies, --prices, --target-metric, --objective)",
        )
        if cluster is None:
            raise InputError.at(None, "--cluster", "needed with --trace, e.g. --cluster aws:6,dgx-ext:2,rtx:3")
        _simulate_trace(trace, cluster, policies, prices, target_metric, objective or "time", json_out)
        return
    _refuse(trace_given, "without --trace DIR (it belongs to a trace simulation)")
    if config is None or trajectory is None:
        raise InputError.at(
            None, "simulate", "expected -c FILE --trajectory SPEC, or --trace DIR --cluster TYPE:NODES,..."
        )
    _simulate_trajectory(config, trajectory, epochs, dataset_size, json_out)


def _refuse(given: dict[str, object], when: str) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise InputError.at(None, named[0], f"not used {when}")


def _simulate_trace(
    trace: Path,
    cluster: str,
    policies: str | None,
    prices: str | None,
    target_metric: float | None,
    objective: str,
    json_out: bool,
) -> None:
    from jabascli.simulate import POLICIES, simulate_trace
    from jabascli.simulate.cluster import parse_prices

    names = [p.strip() for p in policies.split(",") if p.strip()] if policies is not None else list(POLICIES)
    if not names:
        raise InputError.at(None, "--policies", f"no policy named; expected some of {', '.join(POLICIES)}")
    overrides = parse_prices(prices) if prices is not None else None
    with err_console.status(f"simulating {trace} on {cluster}", spinner="dots"):
        result = simulate_trace(
            trace, cluster, names, prices=overrides, target_metric=target_metric, objective=objective
        )
    if json_out:
        print_json(result.to_json())
        return
    ends = "the trace's end" if target_metric is None else f"metric {target_metric:g}"
    table = Table(title=f"{result.trace} on {cluster}, to {ends}")
    columns = ("policy", "time (h)", "cost ($)", "GPU-hours", "moves", "GBS", "time / fastest", "cost / cheapest")
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    ratios = result.relative()
    unpriced = not any(result.prices.values())  # every price 0 (--prices): no cost to show
    for p in result.policies:
        time_ratio, cost_ratio = ratios.get(p.policy, (None, None))
        gbs = sorted({round(e["gbs"]) for e in p.timeline})
        table.add_row(
            p.policy,
            f"{p.time_s / 3600:.2f}",
            "-" if unpriced else f"{p.cost:.2f}",
            f"{p.gpu_hours:.1f}",
            str(p.moves),
            f"{gbs[0]}" if len(gbs) == 1 else f"{gbs[0]}-{gbs[-1]}",
            "-" if time_ratio is None else f"{time_ratio:.2f}",
            "-" if cost_ratio is None else f"{cost_ratio:.2f}",
        )
    console.print(table)
    if unpriced:
        err_console.print("note: every price is 0: costs are not shown (-)", highlight=False)
    if result.get("jabas") is not None:
        beaten = result.dominating()
        console.print(
            f"objective {objective}: "
            + (
                f"{', '.join(beaten)} both sooner and cheaper than jabas"
                if beaten
                else "no baseline is both sooner and cheaper than jabas"
            ),
            highlight=False,
        )
    if target_metric is not None:
        missed = [p.policy for p in result.policies if not p.target_reached]
        if missed:
            err_console.print(f"note: {', '.join(missed)} ended with the trace before reaching {target_metric:g}")


def _simulate_trajectory(
    config: Path, trajectory: str, epochs: int | None, dataset_size: int | None, json_out: bool
) -> None:
    from jabascli.autoscale.simulate import POLICIES, simulation_from_config

    sim = simulation_from_config(load_config(config), trajectory, epochs=epochs, dataset_size=dataset_size)
    results = [sim.run(p) for p in POLICIES]
    if json_out:
        print_json(sim.to_dict(results))
        return
    values = sim.trajectory.values
    table = Table(
        title=f"{sim.epochs} epochs of {sim.dataset_size} samples, GBS {values[0]} -> {values[-1]} "
        f"({sim.trajectory.source}), objective {sim.objective.kind}"
    )
    for column in ("policy", "time (h)", "cost", "GPU-hours", "moves", "GPUs used"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    # No price_per_hour and no tflops anywhere: every cost would read 0.00, which is no price, not free.
    unpriced = sim.space.price_per_hour(sim.space.everything()) == 0
    for r in results:
        gpus = sorted({e.gpus for e in r.epochs})
        if r.time_s is None:
            table.add_row(r.policy, "cannot run", "-", "-", str(r.moves), ",".join(map(str, gpus)))
            continue
        assert r.cost is not None and r.gpu_hours is not None
        table.add_row(
            r.policy,
            f"{r.time_s / 3600:.2f}",
            "-" if unpriced else f"{r.cost:.2f}",
            f"{r.gpu_hours:.1f}",
            str(r.moves),
            ",".join(map(str, gpus)),
        )
    console.print(table)
    if unpriced:
        err_console.print("note: no server has a price_per_hour or tflops: costs are not shown (-)", highlight=False)
    elif sim.space.seed_prices:
        err_console.print(
            "note: no server has a price_per_hour; costs use the seed's rule, 3.06 $ per GPU-hour x TFLOPS / 14.13",
            highlight=False,
        )
