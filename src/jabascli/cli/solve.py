"""``jabas solve``: the fastest configuration for a global batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, not_implemented


@cli_command
def solve(
    config: ConfigOption,
    gbs: Annotated[int | None, typer.Option(help="Global batch size to solve for.")] = None,
    range_: Annotated[str | None, typer.Option("--range", help="LO:HI: the best plan for every feasible GBS.")] = None,
    servers: Annotated[
        str | None, typer.Option(help="'auto' to choose servers, or a comma list (default: all available).")
    ] = None,
    weight_sync: Annotated[str, typer.Option(help="recommend, sequential or overlap.")] = "recommend",
    out: Annotated[Path | None, typer.Option(help="Write the plan for `jabas train` to this file.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Best LBS, weight sync and (VSW, GA) per device for a global batch size.

    Example:

        jabas solve -c quickstart/config.json --gbs 512

        jabas solve -c jabas.toml --range 256:8192 --json
    """
    not_implemented("solve", 5)
