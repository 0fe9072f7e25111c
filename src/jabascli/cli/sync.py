"""``jabas sync``: gather profile folders from every server and broadcast the union."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import JsonOption, cli_command, not_implemented


@cli_command
def sync(
    local_dir: Annotated[Path, typer.Argument(help="Each server's own profile folder.")],
    gathered_dir: Annotated[Path, typer.Argument(help="Where the merged profiles go, on every server.")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Job config naming the servers.")] = Path("jabas.toml"),
    servers: Annotated[str | None, typer.Option(help="Comma-separated server names (default: all).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would move, move nothing.")] = False,
    accept_new_host_keys: Annotated[
        bool, typer.Option("--accept-new-host-keys", help="Trust and record host keys not yet in known_hosts.")
    ] = False,
    json_out: JsonOption = False,
) -> None:
    """Gather every server's profiles over SSH, merge them, and push the union back.

    Example:

        jabas sync profiles/local profiles/all -c jabas.toml --dry-run
    """
    not_implemented("sync", 7)
