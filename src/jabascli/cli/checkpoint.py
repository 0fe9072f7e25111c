"""``jabas checkpoint``: work with a job's checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import cli_command, console, err_console

app = typer.Typer(help="Work with a job's checkpoints.", no_args_is_help=True)


@app.command()
@cli_command
def export(
    source: Annotated[
        Path,
        typer.Argument(
            help="A job's checkpoint folder (<checkpoint_dir>/<job>: its newest intact checkpoint), or one "
            "checkpoint-<step>.pt file or checkpoint-<step>.dcp folder.",
            show_default=False,
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The file to write.", show_default=False)],
) -> None:
    """Write a checkpoint's whole model as a plain torch.save dict of tensors.

    Works for a checkpoint of any layout: plain IIDP, or sharded, tensor
    parallel or pipelined (a parallel section in the config), whose shards are
    gathered here. Load it with
    model.load_state_dict(torch.load("model.pt", weights_only=True)).
    A missing or corrupt checkpoint is an error (exit 2), and nothing is written.

    Example:

        jabas checkpoint export checkpoints/quickstart --out model.pt
    """
    from jabascli.engine.export import export_model  # torch: only when exporting

    exported = export_model(source, out)
    for line in exported.passed_over:
        err_console.print(f"note: {line}; exporting {exported.checkpoint}", highlight=False)
    console.print(
        f"wrote {exported.out}: {exported.tensors} tensors, {exported.elements:,} values, "
        f"from {exported.checkpoint} (step {exported.step})",
        highlight=False,
    )
