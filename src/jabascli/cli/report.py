"""``jabas report``: plots and a page for a run folder or a simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import cli_command, console


@cli_command
def report(
    source: Annotated[
        Path,
        typer.Argument(help="A run folder (runs/<job>) or the JSON of `jabas simulate --json`.", show_default=False),
    ],
    out: Annotated[
        Path | None, typer.Option(help="Folder for the PNGs and index.html (default: RUN_DIR/report, SIM-report/).")
    ] = None,
) -> None:
    """PNG plots (loss, validation accuracy, GBS, LR, throughput, allocation) and an index.html.

    For a simulation: GPUs, GBS, cumulative time and cost per epoch for each
    policy; for a trace simulation (--trace): GBS, GPUs and progress over time
    per policy, and each adaptive policy's allocation by GPU type. Works on a
    run that is still going: it shows what is logged so far.

    Example:

        jabas report runs/quickstart

        jabas simulate -c jabas.toml --trajectory grow:256:8192 --json > sim.json && jabas report sim.json

        jabas report trace.json   # from jabas simulate --trace DIR --cluster aws:2,rtx:1 --json > trace.json
    """
    from jabascli.report import write_report  # matplotlib: only when reporting

    written = write_report(source, out)
    for image in written.images:
        console.print(f"wrote {image}", highlight=False)
    console.print(f"open {written.index}", highlight=False)
