"""A fork server: one process that has imported torch forks every trainer a launcher starts.

A trainer's interpreter spends most of its start importing torch and what its
first optimizer pulls in (``torch._dynamo``): about 5 CPU-seconds on a small
host, paid again by every rank. A launcher that asks a fork server instead pays
it once: the server imports them (:data:`TRAINER_PRELOAD`), then forks one
child per request, which becomes the command a fresh ``python -m`` would have
run, with the requester's arguments, environment, working folder, output file
and file descriptors. Its pages stay shared with the server until written.

The server is itself forked from the launcher where the launcher runs one
Python thread (a fork copies only the calling thread, and a lock another thread
held would stay held in the copy): it then starts with what the launcher already
imported (``jabas run`` imports the job's workload, so torch) and imports only
the rest. Elsewhere (a launcher with threads, or one given another environment
for the server) it is a fresh ``python -m jabascli.forkserver_main``.

The server never initialises CUDA (a forked child could not use it); if its
imports did, or the launcher had, it says so and the launcher starts fresh
processes instead, as it does where there is no ``fork`` or where
``JABAS_FORK_SERVER=0``.

Protocol, over a Unix ``SOCK_SEQPACKET`` pair (the server's stdin; one JSON
message per packet, never the network, nothing unpickled):

* server -> launcher, once: ``{"ready": true}`` or ``{"error": "..."}``;
* launcher -> server: ``{"entry": "pkg.mod:func", "argv": [...], "env": {...},
  "cwd": "...", "fds": [N, ...], "session": bool, "name": "..."}`` with the
  child's output file and then each fd of ``fds`` attached (``SCM_RIGHTS``);
  the child gets those at their numbers;
* server -> launcher: ``{"pid": N}`` per request, in order, and
  ``{"pid": N, "exit": CODE}`` when that child ends (negative: killed by that
  signal, as :attr:`subprocess.Popen.returncode`).

The server ignores Ctrl-C (the launcher ends what it started), dies with the
launcher (``PR_SET_PDEATHSIG``), and its children die with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jabascli.children import PREEXEC
from jabascli.forkserver_main import PACKET_BYTES, serve_forked

DISABLE_ENV = "JABAS_FORK_SERVER"
"""``0``: start every trainer as a fresh process."""
TRAINER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "jabascli.engine.process", "jabascli.cli.app")
"""What a trainer imports: ``torch._dynamo`` comes with the first optimizer, half of torch's import time. A
preload may also be ``module:function``: the module imported, then the function called once in the server."""
READY_TIMEOUT_S = 300.0


class Unavailable(Exception):
    """No fork server here: the caller starts fresh processes."""


class ForkServer:
    """The launcher's side: a running server and the children it forked for us."""

    def __init__(self, preload: Sequence[str] = TRAINER_PRELOAD, env: Mapping[str, str] | None = None) -> None:
        """Start a server that imports ``preload``, in the environment ``env`` (default: ours), without waiting
        for it (:meth:`ready`)."""
        if not hasattr(os, "fork") or not hasattr(socket, "send_fds") or os.environ.get(DISABLE_ENV) == "0":
            raise Unavailable("no fork here")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if env is None and _single_threaded():
            pid = os.fork()
            if pid == 0:
                serve_forked(theirs, preload)
            theirs.close()
            self.proc: subprocess.Popen[bytes] | _ServerChild = _ServerChild(pid)
        else:
            self.proc = self._start_fresh(theirs, preload, env)
        self.sock = ours
        self.lock = threading.Lock()
        self.children: dict[int, Forked] = {}
        self.started = False

    @staticmethod
    def _start_fresh(
        theirs: socket.socket, preload: Sequence[str], env: Mapping[str, str] | None
    ) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "jabascli.forkserver_main", *preload],
                stdin=theirs,
                env=None if env is None else dict(env),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=PREEXEC,
                start_new_session=True,  # a terminal's Ctrl-C goes to the launcher, which ends what it started
            )
        finally:
            theirs.close()

    def ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether the server has imported its preload, waiting up to ``timeout`` for it to say so.

        Raises :class:`Unavailable` when it failed to (and ends it).
        """
        if not self.started:
            with self.lock:
                hello = self._receive(timeout)
            if hello is None and self.sock.fileno() >= 0 and self.proc.poll() is None:
                return False  # still importing
            if hello is None or not hello.get("ready"):
                self.close()
                raise Unavailable(str((hello or {}).get("error", "the fork server did not start")))
            self.started = True
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() >= 0

    def spawn(
        self,
        entry: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        output: int,
        pass_fds: Sequence[int] = (),
        cwd: str | None = None,
        new_session: bool = False,
        name: str = "",
    ) -> Forked:
        """Fork a child running ``entry`` (``"module:function"``) with ``sys.argv[1:] = argv``, stdout and
        stderr to the file descriptor ``output``, stdin from /dev/null, and ``pass_fds`` at the same numbers.

        ``name`` is its process name (``ps -o comm``, 15 bytes at most). Raises :class:`Unavailable` when the
        server is gone. Waits for the server to be :meth:`ready` first.
        """
        if not self.ready():
            raise Unavailable(f"the fork server took over {READY_TIMEOUT_S:g} s to start")
        request = {
            "entry": entry,
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "fds": list(pass_fds),
            "session": new_session,
            "name": name,
        }
        attached = [output, *pass_fds]
        with self.lock:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], attached)
            except OSError as exc:
                raise Unavailable(f"the fork server is gone ({exc})") from None
            while True:
                reply = self._receive(READY_TIMEOUT_S)
                if reply is None:
                    raise Unavailable("the fork server is gone")
                if "pid" in reply and "exit" not in reply:
                    child = Forked(self, int(reply["pid"]))
                    self.children[child.pid] = child
                    return child
                if "error" in reply:
                    raise Unavailable(str(reply["error"]))
                self._note(reply)

    def collect(self, timeout: float = 0.0) -> None:
        """Take in what the server said of ended children, waiting up to ``timeout`` for a first message."""
        with self.lock:
            while True:
                reply = self._receive(timeout)
                if reply is None:
                    return
                self._note(reply)
                timeout = 0.0

    def close(self) -> None:
        """End the server. Its children, if any are left, die with it, and are told as killed: the ends it
        reported first keep their codes."""
        self.collect()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for child in self.children.values():
            child.returncode = -signal.SIGKILL
        self.children.clear()

    def _note(self, reply: dict[str, Any]) -> None:
        if "exit" in reply:
            pid, code = int(reply["pid"]), int(reply["exit"])
            child = self.children.pop(pid, None)
            if child is not None:
                child.returncode = code

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """One message; None after ``timeout`` without one. When the server has died, every child we still
        count as running is dead too (it dies with the server): marked killed, and None."""
        if self.sock.fileno() < 0:
            return None
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        try:
            data = self.sock.recv(PACKET_BYTES)
        except OSError:
            data = b""
        if not data:
            for child in self.children.values():
                child.returncode = -signal.SIGKILL
            self.children.clear()
            self.sock.close()
            return None
        message = json.loads(data)
        return message if isinstance(message, dict) else {}


class Forked:
    """A forked child, used as a :class:`subprocess.Popen`: ``pid``, ``poll``, ``wait``, ``send_signal``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
            self.server.collect(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the server: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ServerChild:
    """A server forked from this process, used as the :class:`subprocess.Popen` of a fresh one would be."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _single_threaded() -> bool:
    """Whether this process runs no Python thread but the main one.

    A fork copies only the calling thread; a lock another Python thread held (the import lock, a stream's)
    would stay held in the copy. Native thread pools are not counted: numpy's OpenBLAS starts one at import and
    re-forms it after a fork (``pthread_atfork``), as it does in every trainer a fresh server forks. A launcher
    runs no parallel torch operation before it starts its server (so torch's OpenMP pool is not started).
    """
    return threading.active_count() == 1


_shared: dict[tuple[str, ...], ForkServer] = {}
_shared_failed: dict[tuple[str, ...], str] = {}
_shared_lock = threading.Lock()


def shared_server(preload: Sequence[str] = TRAINER_PRELOAD) -> ForkServer:
    """This process's fork server for children that import ``preload`` (trainers by default), started on first
    use and kept for later launches (a restart, the next run a library caller launches).

    It dies with the thread that first asked for it (``PR_SET_PDEATHSIG`` is per thread): launchers ask from
    their main thread. Raises :class:`Unavailable` where there is none, and from then on without trying again.
    """
    key = tuple(preload)
    with _shared_lock:
        if key in _shared_failed:
            raise Unavailable(_shared_failed[key])
        try:
            if key not in _shared or not _shared[key].alive():
                _shared[key] = ForkServer(key)
            _shared[key].ready()
        except Unavailable as exc:
            _shared_failed[key] = str(exc)
            raise
        return _shared[key]


def start_shared_server(preload: Sequence[str] = TRAINER_PRELOAD) -> None:
    """Start :func:`shared_server` now, without waiting for its imports (it waits, when children are to start).

    A launcher calls it while it runs one Python thread, before it starts others (a progress display's, a
    lifeline's), so that the server is forked from it and starts with what it imported.
    """
    key = tuple(preload)
    with _shared_lock:
        if key not in _shared and key not in _shared_failed:
            try:
                _shared[key] = ForkServer(key)
            except Unavailable as exc:
                _shared_failed[key] = str(exc)


@atexit.register
def _close_shared() -> None:
    """End the shared servers with this process, and wait for them (their time counts as this process's
    children's)."""
    for server in _shared.values():
        server.close()
