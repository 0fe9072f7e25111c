"""``jabas schedule`` and ``jabas worker``: the elastic scheduler and its node agents."""

from __future__ import annotations

from typing import Annotated

import typer

from jabascli.cli.common import ConfigOption, cli_command, not_implemented


@cli_command
def schedule(
    config: ConfigOption,
    address: Annotated[str | None, typer.Option(help="Address to bind (default: \\[scheduler] address).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default: \\[scheduler] port).")] = None,
) -> None:
    """Run the elastic scheduler on the main node.

    It decides, at epoch ends, which servers the job runs on, and tells the
    workers to stop and start trainers. It binds to loopback unless configured
    and requires the token in [scheduler] token_file.

    Example:

        jabas schedule -c jabas.toml
    """
    not_implemented("schedule")


@cli_command
def worker(
    config: ConfigOption,
    rank: Annotated[int, typer.Option(help="This node's rank among the workers.")],
    scheduler: Annotated[
        str | None, typer.Option(help="ADDR:PORT of the scheduler (default: from the config).")
    ] = None,
) -> None:
    """Run the agent of one node: register with the scheduler, start and stop trainers.

    Example:

        jabas worker -c jabas.toml --rank 1
    """
    not_implemented("worker")
