"""``jabas train`` and ``jabas run``: train a job."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, not_implemented, print_json
from jabascli.config import load_config


@cli_command
def train(
    config: ConfigOption,
    plan: Annotated[Path | None, typer.Option(help="A plan from `jabas solve --out` (default: [job] plan).")] = None,
    resume: Annotated[Path | None, typer.Option(help="Checkpoint to resume from.")] = None,
) -> None:
    """Run one trainer process; rank and world come from the torch.distributed environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so it runs
    under plain torchrun as well as under `jabas run` and `jabas worker`.

    Example:

        torchrun --nproc-per-node 2 -m jabascli train -c jabas.toml
    """
    not_implemented("train", 3)


@cli_command
def run(config: ConfigOption, json_out: JsonOption = False) -> None:
    """Train the whole job on this machine: scheduler, worker and trainers in one command.

    Example:

        jabas run -c examples/quickstart.toml
    """
    from jabascli.engine.local import fixed_gbs, train_single_process

    loaded = load_config(config)
    cfg = loaded.config
    lbs, gbs = fixed_gbs(loaded)
    with Progress(
        TextColumn("[bold]epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        console=console,
        disable=json_out,
        transient=True,
    ) as progress:
        task = progress.add_task("train", total=None, epoch=0, loss=float("nan"))

        def on_step(epoch: int, step: int, loss: float) -> None:
            progress.update(task, completed=step + 1, epoch=epoch + 1, loss=loss)

        results = train_single_process(loaded, on_step)
    if json_out:
        print_json([r.__dict__ for r in results])
        return
    table = Table(title=f"{cfg.job.name}: LBS {lbs}, GBS {gbs}")
    for column in ("epoch", "train loss", "val loss", "val accuracy"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r.epoch + 1),
            f"{r.train_loss:.4f}",
            "-" if r.val_loss is None else f"{r.val_loss:.4f}",
            "-" if r.val_accuracy is None else f"{r.val_accuracy:.4f}",
        )
    console.print(table)
    if results and results[-1].val_accuracy is not None:
        console.print(f"validation accuracy: {results[-1].val_accuracy:.4f}")
