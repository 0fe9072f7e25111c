"""Worker agents on other machines, started over SSH: ``jabas run`` on a cluster config.

A server whose ``host`` is not this machine (:func:`jabascli.net.is_local`) gets its agent,
``jabas worker --rank R --stdin``, started over SSH (paramiko, with the host-key
and ``~/.ssh/config`` rules of ``jabas sync``: :mod:`jabascli.ssh`). What every
node must share with this one is the job's folder: the config, the workload and
``[storage]`` are read at the same absolute paths there (a shared file system,
as Slurm clusters have), and the Python that runs jabas is the server's
``python`` (default: the path of the one running here).

Before anything starts, :func:`connect_nodes` connects to every remote server
at once and checks that its Python runs the same jabas version and that it sees
the config and the working folder; each server that fails is named in one line.

The token reaches the agent on its standard input (:mod:`jabascli.elastic.lifeline`),
never on a command line or in a file on the node. The agent's output comes back
line by line, each handed to ``on_line(server, line)``. Standard input stays
open while the agent runs: closing it (:meth:`RemoteAgent.end`, or the SSH
session dropping with this process) ends the agent and its trainers; an agent
that still runs after :data:`END_GRACE_S` is killed by its pid, which it prints
when it starts.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.ssh_exception import SSHException

from jabascli import __version__
from jabascli.config import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.elastic.lifeline import LaunchOrder
from jabascli.errors import Problem, RuntimeFailure
from jabascli.ssh import SshError
from jabascli.ssh.connect import KnownHosts, open_client
from jabascli.ssh.target import load_ssh_config, resolve_target

CHECK_TIMEOUT_S = 60.0
"""How long the version check may take on a node (its Python imports jabas's command line)."""
END_GRACE_S = 15.0
"""How long an agent has to end its trainers once its standard input closed."""
PID_LINE = re.compile(rb"worker rank \d+, pid (\d+),")

OnLine = Callable[[str, str], None]
"""Called with a server's name and one line its agent printed."""


@dataclass(frozen=True)
class SshOptions:
    """How to reach the servers: as ``jabas sync`` does (``--known-hosts``, ``--ssh-config``, ...)."""

    known_hosts: Path | None = None
    ssh_config: Path | None = None
    accept_new_host_keys: bool = False
    timeout_s: float = 15.0


def python_of(server: ServerConfig) -> str:
    return server.python or sys.executable


@dataclass
class Node:
    """A remote server with its checked SSH connection."""

    rank: int
    server: ServerConfig
    client: paramiko.SSHClient
    where: str
    """``user@host:port``, for messages."""


def connect_nodes(loaded: LoadedConfig, ranks: Sequence[int], options: SshOptions) -> list[Node]:
    """Connect to every server of ``ranks`` at once and check it can run this job's agent.

    RuntimeFailure with one line per server that cannot (unreachable, refused, another jabas version,
    no jabas, the config not at the same path); nothing has started on any node then.
    """
    ssh_config = load_ssh_config(options.ssh_config)
    known = KnownHosts(options.known_hosts, accept_new=options.accept_new_host_keys)
    servers = loaded.config.cluster.servers

    def check(rank: int) -> Node | Problem:
        server = servers[rank]
        try:
            target = resolve_target(server, ssh_config)
            client, _ = open_client(target, known, timeout=options.timeout_s)
        except SshError as exc:
            return Problem(f"server {server.name!r}", None, str(exc))
        node = Node(rank, server, client, target.address)
        problem = _check_node(node, loaded, options.timeout_s)
        if problem is not None:
            client.close()
            return Problem(f"server {server.name!r} ({target.address})", None, problem)
        return node

    with ThreadPoolExecutor(max_workers=max(1, len(ranks))) as pool:
        results = list(pool.map(check, ranks))
    problems = [r for r in results if isinstance(r, Problem)]
    nodes = [r for r in results if isinstance(r, Node)]
    if problems:
        for node in nodes:
            node.client.close()
        raise RuntimeFailure(problems)
    return nodes


def _check_node(node: Node, loaded: LoadedConfig, timeout: float) -> str | None:
    """What keeps ``node`` from running this job's agent, or None."""
    python = python_of(node.server)
    try:
        code, output = _run(node.client, [python, "-m", "jabascli", "--version"], timeout)
    except (SSHException, OSError, EOFError) as exc:
        return f"cannot run a command there: {exc or type(exc).__name__}"
    if code != 0:
        last = output.strip().splitlines()[-1:] or [f"exit code {code}"]
        return f"{python} -m jabascli does not run there ({last[0][:200]}); set the server's python"
    version = output.strip().removeprefix("jabas ").strip()
    if version != __version__:
        return f"runs jabas {version}, this machine {__version__}: install the same version on every node"
    try:
        with node.client.open_sftp() as sftp:
            for what, path in (("the config", loaded.path), ("the working folder", Path.cwd())):
                try:
                    sftp.stat(str(path))
                except OSError:
                    return f"{what} {path} is not there: every node reads the job from the same paths"
    except (SSHException, OSError, EOFError) as exc:
        return f"cannot look at its files over SFTP: {exc or type(exc).__name__}"
    return None


def _run(client: paramiko.SSHClient, argv: list[str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` (quoted for the remote shell) to its end; its exit code and output."""
    channel = client.get_transport().open_session(timeout=timeout)  # type: ignore[union-attr]
    try:
        channel.settimeout(timeout)
        channel.set_combine_stderr(True)
        channel.exec_command(shlex.join(argv))
        channel.shutdown_write()
        chunks = []
        while chunk := channel.recv(65536):
            chunks.append(chunk)
        return channel.recv_exit_status(), b"".join(chunks).decode(errors="replace")
    finally:
        channel.close()


class RemoteAgent:
    """One node's ``jabas worker``, running over its SSH connection; polled like a ``subprocess.Popen``."""

    def __init__(self, node: Node, channel: paramiko.Channel, on_line: OnLine) -> None:
        self.node = node
        self.name = node.server.name
        self.channel = channel
        self.pid: int | None = None
        self.returncode: int | None = None
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, name=f"agent-{self.name}", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, node: Node, argv: list[str], order: LaunchOrder, on_line: OnLine) -> RemoteAgent:
        """Run ``argv`` in this machine's working folder on the node and hand it ``order`` on its stdin."""
        command = f"cd {shlex.quote(str(Path.cwd()))} && exec {shlex.join(argv)}"
        try:
            channel = node.client.get_transport().open_session()  # type: ignore[union-attr]
            channel.set_combine_stderr(True)
            channel.exec_command(command)
            channel.sendall(order.line())
        except (SSHException, OSError, EOFError) as exc:
            raise RuntimeFailure.at(f"server {node.server.name!r}", None, f"cannot start its agent: {exc}") from None
        return cls(node, channel, on_line)

    def _read(self) -> None:
        buffer = b""
        with contextlib.suppress(SSHException, OSError, EOFError):
            while chunk := self.channel.recv(65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    if self.pid is None and (found := PID_LINE.search(line)):
                        self.pid = int(found.group(1))
                    self._on_line(self.name, line.decode(errors="replace").rstrip("\r"))
        if buffer:
            self._on_line(self.name, buffer.decode(errors="replace"))

    def poll(self) -> int | None:
        if self.returncode is None and self.channel.exit_status_ready():
            self.returncode = self.channel.recv_exit_status()
        if self.returncode is None and self.channel.closed:
            self.returncode = -1  # the session ended without an exit status: the connection was lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the agent of {self.name} is still running")
            time.sleep(0.05)
        return code

    def end(self, grace_s: float = END_GRACE_S) -> None:
        """Close its standard input (it ends its trainers and exits); past ``grace_s``, kill it by its pid."""
        with contextlib.suppress(SSHException, OSError, EOFError):
            self.channel.shutdown_write()
        try:
            self.wait(grace_s)
        except TimeoutError:
            if self.pid is not None:
                with contextlib.suppress(SSHException, OSError, EOFError):
                    _run(self.node.client, ["kill", "-KILL", str(self.pid)], CHECK_TIMEOUT_S)
        self.close()

    def kill(self) -> None:
        self.end(grace_s=1.0)

    def close(self) -> None:
        self.channel.close()
        self._reader.join(2.0)
        self.node.client.close()


def worker_argv(loaded: LoadedConfig, node: Node, scheduler: str) -> list[str]:
    python = python_of(node.server)
    config = str(loaded.path)
    return [
        python,
        "-m",
        "jabascli",
        "worker",
        "-c",
        config,
        "--rank",
        str(node.rank),
        "--scheduler",
        scheduler,
        "--stdin",
    ]
