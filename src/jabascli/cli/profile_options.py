"""The options the ``jabas profile`` commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

OutOption = Annotated[
    Path | None, typer.Option("--out", help="Output folder (default: the folder named in the config's \\[profiles]).")
]
ServerOption = Annotated[
    str | None, typer.Option("--server", help="This node's server name in the config (default: the first server).")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Measure again what is already on disk.")]
LaunchedOption = Annotated[
    bool,
    typer.Option(
        "--launched",
        hidden=True,
        help="Run by `jabas profile all` of a cluster: progress as JSON lines on stdout, and stop as Ctrl-C "
        "would when standard input closes.",
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="torch threads per measuring process (default on the CPU: what `jabas run` gives each trainer, "
        "the cores over the trainers on this machine)."
    ),
]
