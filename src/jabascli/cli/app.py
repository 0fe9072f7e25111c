"""The ``jabas`` command: one Typer app with every command group registered."""

from __future__ import annotations

import typer

from jabascli import __version__
from jabascli.cli import (
    checkpoint,
    cluster,
    elastic,
    init,
    profile,
    report,
    simulate,
    slurm,
    solve,
    sync,
    train,
    validate,
)

app = typer.Typer(
    name="jabas",
    help=(
        "Train PyTorch models data-parallel on a cluster of different GPUs, with adaptive batching "
        "and automatic scaling (JABAS, on IIDP).\n\n"
        "Quick start: jabas run -c examples/quickstart.toml"
    ),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"jabas {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Train PyTorch models data-parallel on heterogeneous GPUs."""


app.command("init")(init.init)
app.command("validate")(validate.validate)
app.add_typer(cluster.app, name="cluster")
app.add_typer(profile.app, name="profile")
app.command("sync")(sync.sync)
app.command("solve")(solve.solve)
app.command("schedule")(elastic.schedule)
app.command("worker")(elastic.worker)
app.command("token")(elastic.token)
app.add_typer(elastic.job_app, name="job")
app.add_typer(slurm.app, name="slurm")
app.command("train")(train.train)
app.command("run")(train.run)
app.command("simulate")(simulate.simulate)
app.command("report")(report.report)
app.add_typer(checkpoint.app, name="checkpoint")


def main() -> None:
    app()
