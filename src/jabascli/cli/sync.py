"""``jabas sync``: gather profile folders from every server and broadcast the union."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.filesize import decimal
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Table

from jabascli.cli.common import JsonOption, cli_command, console, err_console, print_json
from jabascli.config import load_config
from jabascli.errors import RuntimeFailure

if TYPE_CHECKING:
    from jabascli.sync import SyncEvent, SyncReport

# jabascli.sync brings paramiko, a fifth of every jabas command's start: it is imported when a sync runs.


@cli_command
def sync(
    local_dir: Annotated[Path, typer.Argument(help="Each server's own profile folder.")],
    gathered_dir: Annotated[Path, typer.Argument(help="Where the merged profiles go, here and on every server.")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Job config naming the servers.")] = Path("jabas.toml"),
    servers: Annotated[str | None, typer.Option(help="Comma-separated server names (default: all).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would move, move nothing.")] = False,
    accept_new_host_keys: Annotated[
        bool, typer.Option("--accept-new-host-keys", help="Trust and record host keys not yet in known_hosts.")
    ] = False,
    known_hosts: Annotated[
        Path | None,
        typer.Option(
            envvar="JABAS_KNOWN_HOSTS",
            help="Host keys to check servers against (default: ~/.ssh/known_hosts).",
            show_default=False,
        ),
    ] = None,
    ssh_config: Annotated[
        Path | None,
        typer.Option(
            envvar="JABAS_SSH_CONFIG",
            help="OpenSSH client config for hosts, users, ports, keys (default: ~/.ssh/config).",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=1, help="Seconds to wait for a server to connect or answer before giving it up.")
    ] = 15.0,
    json_out: JsonOption = False,
) -> None:
    """Gather every server's profiles over SSH, merge them, and push the union back.

    Fetches each server's LOCAL_DIR into GATHERED_DIR here, then sends GATHERED_DIR
    to every server; only files that differ (size + SHA-256) move. Relative folders
    are the same path on every server as here, or relative to a server's sync_root.
    Files that differ between servers are reported, not copied. Exit code 1 when a
    server failed or a file conflicts (the other servers are still synced).

    Example:

        jabas sync profiles/local profiles/all -c jabas.toml --dry-run
    """
    from jabascli.sync import SyncOptions, sync_profiles

    # paramiko logs a cut connection as an error of its own; the report already says it in one line.
    paramiko_log = logging.getLogger("paramiko")
    if not paramiko_log.handlers:
        paramiko_log.addHandler(logging.NullHandler())
    loaded = load_config(config, check_profiles=False)
    names = None if servers is None else [n.strip() for n in servers.split(",") if n.strip()]
    options = SyncOptions(
        dry_run=dry_run,
        accept_new_host_keys=accept_new_host_keys,
        known_hosts=known_hosts,
        ssh_config=ssh_config,
        timeout=timeout,
    )
    if json_out or not err_console.is_terminal:
        report = sync_profiles(loaded, local_dir, gathered_dir, servers=names, options=options)
    else:
        with _ProgressView() as view:
            report = sync_profiles(loaded, local_dir, gathered_dir, servers=names, options=options, on_event=view)
    if json_out:
        print_json(report.to_dict())
    else:
        print_report(report)
    if not report.ok:
        raise RuntimeFailure(report.problems())


class _ProgressView:
    """One progress bar per server, fed by the sync's events (from its worker threads)."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.fields[server]}"),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=err_console,
            transient=True,
        )
        self.tasks: dict[str, TaskID] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> _ProgressView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, event: SyncEvent) -> None:
        from jabascli.sync import Failed, Moved, Planned, Status

        with self.lock:
            if event.server not in self.tasks:
                self.tasks[event.server] = self.progress.add_task("", server=event.server, total=None)
            task = self.tasks[event.server]
        match event:
            case Status(text=text):
                self.progress.update(task, description=text)
            case Planned(nbytes=nbytes):
                total = self.progress.tasks[task].total or 0
                self.progress.update(task, total=total + nbytes)
            case Moved(nbytes=nbytes):
                self.progress.advance(task, nbytes)
            case Failed():
                self.progress.update(task, description="[red]failed[/red]")


def _files(count: int, nbytes: int) -> str:
    return f"{count} file{'' if count == 1 else 's'}, {decimal(nbytes)}" if count else "-"


def print_report(report: SyncReport) -> None:
    table = Table(title=f"jabas sync{' --dry-run: nothing was moved' if report.dry_run else ''}")
    moved = ("would fetch", "would send") if report.dry_run else ("fetched", "sent")
    for column in ("server", "address", *moved, "result"):
        table.add_column(column)
    for s in report.servers:
        table.add_row(
            s.server,
            s.address or "-",
            _files(len(s.fetched), sum(m.nbytes for m in s.fetched)),
            _files(len(s.sent), sum(m.nbytes for m in s.sent)),
            "[green]ok[/green]" if s.ok else "[red]failed[/red]",
        )
    console.print(table)
    if report.dry_run and report.moved:
        moves = Table(title="What would move", show_edge=False)
        for column in ("move", "server", "path", "size"):
            moves.add_column(column)
        for s in report.servers:
            for m in s.fetched:
                moves.add_row("fetch", s.server, m.path, decimal(m.nbytes))
            for m in s.sent:
                moves.add_row("send", s.server, m.path, decimal(m.nbytes))
        console.print(moves)
    for s in report.servers:
        for note in s.notes:
            console.print(f"note: {s.server}: {note}", highlight=False, markup=False)
    if report.ok and not report.moved:
        console.print(f"Everything was already in sync with {report.gathered_dir}.", highlight=False)
    elif not report.dry_run:
        console.print(f"Gathered into {report.gathered_dir}.", highlight=False)
