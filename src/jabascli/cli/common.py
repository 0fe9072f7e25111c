"""What every command shares: consoles, common options, error handling.

Commands are thin: they parse options, call the library, and print. Library
errors become one line each on stderr and an exit code (2 for bad input, 1 for
a runtime failure); a Python traceback is shown only with ``JABAS_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from jabascli.errors import JabasError

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])

ConfigOption = Annotated[
    Path,
    typer.Option("--config", "-c", help="Job config: jabas.toml, or the seed's config.json.", show_default=False),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
# How `jabas run` and `jabas profile all` reach the servers of a cluster over SSH (docs/cluster.md).
KnownHostsOption = Annotated[
    Path | None,
    typer.Option("--known-hosts", help="On a cluster: host keys to check servers by (default: ~/.ssh/known_hosts)."),
]
SshConfigOption = Annotated[
    Path | None, typer.Option("--ssh-config", help="On a cluster: OpenSSH client config (default: ~/.ssh/config).")
]
AcceptNewHostKeysOption = Annotated[
    bool, typer.Option("--accept-new-host-keys", help="On a cluster: trust and record host keys not yet known.")
]


def cli_command(fn: F) -> F:
    """Turn library errors into messages and exit codes instead of tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except JabasError as exc:
            if os.environ.get("JABAS_DEBUG"):
                raise
            for line in exc.lines():
                # escape: a message naming a section, "[scaling] margin", is text, not Rich markup
                err_console.print(f"[red]error:[/red] {escape(line)}", markup=True, highlight=False)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 trainer``, ``2 trainers``; ``many``: the plural where it is not ``word + "s"``."""
    return f"{count} {word}" if count == 1 else f"{count} {many or word + 's'}"


def replicas_line(micro_batches: list[int]) -> str:
    """``1 replica of 8 micro-batches``, ``2 replicas of 8 and 4 micro-batches``: a layout's replicas per iteration."""
    counts = [str(n) for n in micro_batches]
    listed = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} and {counts[-1]}"
    return f"{plural(len(counts), 'replica')} of {listed} micro-batch{'' if counts == ['1'] else 'es'}"


def print_json(obj: Any) -> None:
    """JSON on stdout, with nothing else, for scripts."""
    typer.echo(json.dumps(obj, indent=2, default=str))


def not_implemented(command: str, issue: int | None = None) -> None:
    tracked = f" (tracked in issue #{issue})" if issue else ""
    err_console.print(f"jabas {command}: not implemented yet{tracked}; `jabas {command} --help` shows its options.")
    raise typer.Exit(1)
