"""A profiling command for one server: on its node over the SSH connection checked first, or a child here.

Every command's output lines go to one queue, followed in one thread (:func:`follow`); its standard
input stays open while it runs, and closing it (:meth:`NodeRun.end`) stops the command as Ctrl-C would
(``jabas profile ... --launched``), with a kill by its pid :data:`END_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from paramiko.ssh_exception import SSHException

from jabascli.children import PREEXEC
from jabascli.config.models import ServerConfig
from jabascli.elastic.lifeline import passed_on
from jabascli.elastic.remote import Node, RemoteAgent, python_of
from jabascli.elastic.token import TOKEN_ENV
from jabascli.errors import RuntimeFailure
from jabascli.profiler.common import ShareReporter

END_GRACE_S = 15.0
"""How long a profiling command has to stop once its standard input closed, before it is killed by its pid."""
POLL_S = 0.1


class NodeRun(Protocol):
    """A profiling command running for one server, on its node or here."""

    name: str
    pid: int | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def end(self, grace_s: float = END_GRACE_S) -> None: ...

    def close(self) -> None: ...


Lines = queue.Queue[tuple[str, str]]
"""(server, line): what every running command printed, in the order it arrived."""


def start(server: ServerConfig, node: Node | None, argv: list[str], lines: Lines) -> NodeRun:
    return RemoteRun.begin(node, argv, lines) if node is not None else LocalRun(server.name, argv, lines)


def follow(
    runs: list[NodeRun], lines: Lines, handle: Callable[[NodeRun, str], None], end_all_on_failure: bool = False
) -> dict[str, int]:
    """Hand every line of ``runs`` to ``handle`` (in this thread) until all have exited; their exit codes
    (-1: the connection was lost).

    ``end_all_on_failure``: once one fails, end the others (the inter-node profile: they would wait for it
    until the rendezvous times out). Ctrl-C (or any error) here ends every run first.
    """
    by_name = {run.name: run for run in runs}
    try:
        ending = False
        while True:
            with contextlib.suppress(queue.Empty):
                name, line = lines.get(timeout=POLL_S)
                handle(by_name[name], line)
                continue
            codes = [run.poll() for run in runs]
            if all(code is not None for code in codes):
                break
            if end_all_on_failure and not ending and any(code not in (None, 0) for code in codes):
                ending = True
                for run in runs:
                    if run.poll() is None:
                        run.end()
    except BaseException:
        for run in runs:
            with contextlib.suppress(Exception):
                run.end()
        raise
    for run in runs:
        run.close()  # its output read to the end
    while not lines.empty():
        name, line = lines.get()
        handle(by_name[name], line)
    return {run.name: run.returncode if run.returncode is not None else -1 for run in runs}


@dataclass
class Together:
    """What commands run on several nodes at once said: each one's exit code, ``result`` event, ``error`` event's
    lines and other output, by server."""

    codes: dict[str, int]
    results: dict[str, dict[str, Any]]
    errors: dict[str, list[str]]
    raw: dict[str, list[str]]

    def failure(self, first: str) -> str:
        """Why it failed: the nodes that failed of themselves, not those ended because another had (exit 130, as
        Ctrl-C), each with what it said."""
        failed = {name: code for name, code in self.codes.items() if code != 0}
        own = {name: code for name, code in failed.items() if name in self.errors or code != 130} or failed
        said = [
            f"{name}: {'; '.join(self.errors.get(name) or self.raw[name][-2:] or [exit_reason(code)])}"
            for name, code in own.items()
        ]
        return "; ".join(said) or f"no result from {first}"


def run_together(
    argvs: list[tuple[ServerConfig, list[str]]], nodes: dict[str, Node], reporter: ShareReporter
) -> Together:
    """Run each server's ``--launched`` command on its node (or here) at once, and follow them to their end; once
    one fails the others are ended. ``reporter`` shows the first one's progress and notes, and any other line of a
    node under that node's name."""
    from jabascli.profiler.events import EVENT, parse_event

    first = argvs[0][0].name
    together = Together({}, {}, {}, {server.name: [] for server, _ in argvs})

    def handle(run: NodeRun, line: str) -> None:
        event = parse_event(line)
        if event is None:
            if line.strip():
                together.raw[run.name].append(line)
                reporter.outer.note(f"[{run.name}] {line}")
            return
        kind = event[EVENT]
        if kind == "pid":
            run.pid = int(event["pid"])
        elif kind == "progress" and run.name == first:
            reporter.progress(float(event["completed"]), event.get("total"), str(event["what"]))
        elif kind == "note" and run.name == first:
            reporter.note(str(event["message"]))
        elif kind == "result":
            together.results[run.name] = event
        elif kind == "error":
            together.errors[run.name] = [str(x) for x in event.get("lines", [])]

    lines: Lines = queue.Queue()
    runs: list[NodeRun] = []
    try:
        for server, argv in argvs:
            runs.append(start(server, nodes.get(server.name), argv, lines))
    except BaseException:
        for run in runs:
            run.end()
        raise
    together.codes = follow(runs, lines, handle, end_all_on_failure=True)
    return together


def jabas_argv(server: ServerConfig, here: bool) -> list[str]:
    """How to run jabas for ``server``: this interpreter here; on a node, the server's ``python``, with the
    environment ``jabas run`` passes on to its agents (never a secret: the token's variable is left out)."""
    if here:
        return [sys.executable, "-m", "jabascli"]
    env = [f"{name}={value}" for name, value in sorted(passed_on(dict(os.environ), TOKEN_ENV).items())]
    return [*(["env", *env] if env else []), python_of(server), "-m", "jabascli"]


def exit_reason(code: int | None) -> str:
    if code is None or code < 0:
        return "the connection was lost before it ended"
    if code == 130:
        return "interrupted"
    return f"exited with code {code} and said nothing"


class RemoteRun(RemoteAgent):
    """A command on a node over its checked SSH connection, which stays open for the next command.

    Its output is read as an agent's is; its standard input stays open until :meth:`end` closes it (the
    command then stops as Ctrl-C would stop it), and one still running :data:`END_GRACE_S` later is
    killed by the pid it printed.
    """

    @classmethod
    def begin(cls, node: Node, argv: list[str], lines: Lines) -> RemoteRun:
        command = f"cd {shlex.quote(str(Path.cwd()))} && exec {shlex.join(argv)}"
        try:
            channel = node.client.get_transport().open_session()  # type: ignore[union-attr]
            channel.set_combine_stderr(True)
            channel.exec_command(command)
        except (SSHException, OSError, EOFError) as exc:
            raise RuntimeFailure.at(f"server {node.server.name!r}", None, f"cannot start a command: {exc}") from None
        return cls(node, channel, lambda server, line: lines.put((server, line)))

    def close(self) -> None:
        self._reader.join(END_GRACE_S)  # its output, read to the end
        self.channel.close()


class LocalRun:
    """A command for a server on this machine: a child process that dies with this one, and ends as Ctrl-C
    would end it when its standard input closes."""

    def __init__(self, name: str, argv: list[str], lines: Lines) -> None:
        self.name = name
        self.pid: int | None = None
        self.returncode: int | None = None
        self._process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches this process, which ends it
            preexec_fn=PREEXEC,
        )
        assert self._process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout, lines), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes], lines: Lines) -> None:
        for raw in stream:
            lines.put((self.name, raw.decode(errors="replace").rstrip("\r\n")))

    def poll(self) -> int | None:
        self.returncode = self._process.poll()
        return self.returncode

    def end(self, grace_s: float = END_GRACE_S) -> None:
        with contextlib.suppress(OSError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self.poll()

    def close(self) -> None:
        self._reader.join(END_GRACE_S)
        with contextlib.suppress(OSError):
            assert self._process.stdin is not None
            self._process.stdin.close()
