"""How a profiler's progress is shown: a Rich bar in a terminal, event lines under ``jabas profile all``.

A profiler reports to a :class:`~jabascli.profiler.common.Reporter`; ``reporting`` renders it as one bar
(nothing shown until the profiler reports), ``launched_reporting`` as the event lines a cluster's launcher
reads (:mod:`jabascli.profiler.events`). Either way SIGTERM stops the profiler as Ctrl-C does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from jabascli.cli.common import console
from jabascli.errors import JabasError
from jabascli.profiler.common import Reporter


class ProgressReporter(Reporter):
    """Renders a profiler's progress as one Rich bar, and its notes as lines above it.

    Nothing is shown until the profiler reports, so bad input ends with its message alone.
    """

    def __init__(self, title: str) -> None:
        self._title = title
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task: TaskID | None = None

    def _started(self) -> TaskID:
        if self._task is None:
            console.print(f"[bold]{self._title}[/bold]")
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self._task

    def progress(self, completed: float, total: float | None, what: str) -> None:
        self._progress.update(self._started(), completed=completed, total=total, description=escape(what))

    def note(self, message: str) -> None:
        self._started()
        self._progress.console.print(f"  {message}", highlight=False, markup=False)  # "[fast] ..." is text

    def stop(self) -> None:
        if self._task is not None:
            self._progress.stop()


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM stops a profiler as Ctrl-C does: measuring processes killed, no partial files."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def reporting(title: str, quiet: bool) -> Iterator[Reporter]:
    with terminate_as_interrupt():
        if quiet:
            yield Reporter()
            return
        reporter = ProgressReporter(title)
        try:
            yield reporter
        finally:
            reporter.stop()


def emit(line: str) -> None:
    typer.echo(line)  # flushed: the launcher shows it as it comes


@contextmanager
def launched_reporting() -> Iterator[Reporter]:
    """``--launched``: this command's pid, then its progress, as event lines; the end of standard input
    stops it as Ctrl-C does (its launcher closed it, or the SSH session dropped)."""
    from jabascli.elastic.lifeline import end_when_closed
    from jabascli.profiler.events import LineReporter, event_line

    with terminate_as_interrupt():
        emit(event_line("pid", pid=os.getpid()))
        end_when_closed(sys.stdin.fileno())
        yield LineReporter(emit)


@contextmanager
def launched_errors(launched: bool) -> Iterator[None]:
    """``--launched``: an error is an event line for the launcher (which names the server), and the exit code."""
    if not launched:
        yield
        return
    from jabascli.profiler.events import event_line

    try:
        yield
    except JabasError as exc:
        emit(event_line("error", code=exc.exit_code, lines=exc.lines()))
        raise typer.Exit(exc.exit_code) from None
