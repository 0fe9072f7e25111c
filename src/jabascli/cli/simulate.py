"""``jabas simulate``: a whole training run on the configured cluster, under each allocation policy."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, err_console, print_json
from jabascli.config import load_config


@cli_command
def simulate(
    config: ConfigOption,
    trajectory: Annotated[
        str,
        typer.Option(
            help="The GBS over the run: a run folder (its steps.csv), a CSV of step,gbs, "
            "grow:LO:HI, shrink:HI:LO or flat:G.",
            show_default=False,
        ),
    ],
    epochs: Annotated[int | None, typer.Option(help="Epochs to simulate (default: \\[job] epochs).")] = None,
    dataset_size: Annotated[
        int | None, typer.Option(help="Samples per epoch (default: the workload's training set).")
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Simulate a training run under the policies all, best-fixed, jabas and oracle, without training.

    Iteration times come from the profiles through the performance model and
    the solver; the GBS changes every \\[batching] adjust_interval iterations
    along the trajectory. Prints completion time, cost, GPU-hours and moves
    per policy (--json: {"policies": [{"policy", "time_s", "cost",
    "gpu_hours", "moves", "epochs"}], ...}, what `jabas report` plots).

    Example:

        jabas simulate -c quickstart/config.json --trajectory grow:256:8192 --epochs 30 --dataset-size 1281167

        jabas simulate -c jabas.toml --trajectory runs/job --json > sim.json
    """
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
    for r in results:
        gpus = sorted({e.gpus for e in r.epochs})
        if r.time_s is None:
            table.add_row(r.policy, "cannot run", "-", "-", str(r.moves), ",".join(map(str, gpus)))
            continue
        assert r.cost is not None and r.gpu_hours is not None
        table.add_row(
            r.policy,
            f"{r.time_s / 3600:.2f}",
            f"{r.cost:.2f}",
            f"{r.gpu_hours:.1f}",
            str(r.moves),
            ",".join(map(str, gpus)),
        )
    console.print(table)
    if sim.space.seed_prices:
        err_console.print(
            "note: no server has a price_per_hour; costs use the seed's rule, 3.06 $ per GPU-hour x TFLOPS / 14.13",
            highlight=False,
        )
