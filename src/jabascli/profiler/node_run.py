"""A profiling command for one server: on its node over the SSH connection checked first, or a child here.

Every command's output lines go to one queue, followed in one thread (:func:`follow`); its standard
input stays open while it runs, and closing it (:meth:`NodeRun.end`) stops the command as Ctrl-C would
(``jabas profile ... --launched``), with a kill by its pid :data:`END_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import queue
import shlex
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from paramiko.ssh_exception import SSHException

from jabascli.children import PREEXEC
from jabascli.config.models import ServerConfig
from jabascli.elastic.remote import Node, RemoteAgent
from jabascli.errors import RuntimeFailure

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
