"""The fork server's own process: its loop, and what a child it forks does before it runs its command.

The launcher's side, the protocol and why there is a fork server:
:mod:`jabascli.forkserver`. This module is what runs in the server
(``python -m jabascli.forkserver_main PRELOAD...``, or forked from the launcher
by :func:`serve_forked`) and in each child, up to the child's command.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from jabascli.children import die_with_parent

REAP_S = 0.02
"""How often the server looks for children that ended while no request comes."""
PACKET_BYTES = 1 << 20
"""The largest message either side sends (a request with its environment)."""


def _set_name(name: str) -> None:
    if name and sys.platform == "linux":
        with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
            f.write(name[:15])


def _fresh_streams() -> None:  # pragma: no cover - runs in a forked child
    """``sys.stdin``, ``stdout`` and ``stderr`` over descriptors 0, 1 and 2, as a fresh interpreter makes them
    (the forked ones are the server's, or the launcher's where the server was forked from it: pytest's capture,
    a terminal's encoding)."""
    sys.stdin = sys.__stdin__ = os.fdopen(0, encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = os.fdopen(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = os.fdopen(
        2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )


def _retire_descriptors(keep: set[int]) -> None:  # pragma: no cover - runs in a forked child
    """Point every open descriptor but ``keep`` at /dev/null (close-on-exec) instead of closing it.

    A forked heap still holds the objects that owned them: a file, a socket, the launcher's garbage not yet
    collected. Whichever of them is freed later closes its descriptor's number. Closed now, that number would
    go to the next socket this process opens (a trainer's store connection), and the late close would cut
    it (a broken pipe at the next rendezvous). Held by /dev/null, the number is freed by its owner alone.
    """
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in [int(n) for n in os.listdir("/proc/self/fd")]:
        if fd in keep or fd == devnull:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, closed once listed
        os.dup2(devnull, fd, inheritable=False)
    os.close(devnull)


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket, server: int) -> None:  # pragma: no cover
    """In the forked child of ``server`` (its pid): set up as a fresh process would be, run the entry, and exit
    without returning."""
    code = 1
    try:
        sock.close()
        die_with_parent()
        if os.getppid() != server:
            os._exit(1)  # the server died before the line above asked the kernel to kill us with it
        if request.get("session"):
            os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # The received descriptors to their numbers: first out of the way of every target, then into place.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
        for fd in fds:
            os.close(fd)
        output, *passed = high
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(output, 1)
        os.dup2(output, 2)
        targets = [int(n) for n in request["fds"]]
        for source, target in zip(passed, targets, strict=True):
            os.dup2(source, target)  # inheritable, as subprocess's pass_fds leaves them
        for fd in set(high) - set(targets):  # a target may have a number above 100 too
            os.close(fd)
        _retire_descriptors(keep={0, 1, 2, *targets})  # anything the server held
        _fresh_streams()
        _set_name(str(request.get("name", "")))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts its working folder first
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # torch read it at import, in the server
        module, _, function = str(request["entry"]).partition(":")
        sys.argv = [module, *[str(a) for a in request["argv"]]]
        returned = getattr(importlib.import_module(module), function)()
        code = returned if isinstance(returned, int) else 0  # `sys.exit(main())` in a fresh process
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve_forked(theirs: socket.socket, preload: Sequence[str]) -> None:  # pragma: no cover - a forked child
    """In a server forked from the launcher: become what ``python -m jabascli.forkserver`` would be, serve, and
    exit without returning into the launcher's code (nor running its exit handlers)."""
    code = 1
    try:
        os.setsid()  # a terminal's Ctrl-C goes to the launcher, which ends what it started
        os.dup2(theirs.fileno(), 0)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        _retire_descriptors(keep={0, 1, 2})  # the launcher's files and sockets
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        serve(preload)
        code = 0
    finally:
        os._exit(code)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(preload: Sequence[str]) -> None:
    """The server's loop: fork on each request, report each child's end, stop when the launcher hangs up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        for name in preload:
            module, _, function = name.partition(":")
            imported = importlib.import_module(module)
            if function:  # a warm-up, run once here for every child (jabascli.cli.spare)
                getattr(imported, function)()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialised while importing; a forked child could not use it")
    except Exception as exc:  # told to the launcher, which then starts fresh processes
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return
    _send(sock, {"ready": True})
    running: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], REAP_S if running else None)
        if ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, PACKET_BYTES, 64)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the launcher hung up: our children die with us
            request = json.loads(data)
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become(request, fds, sock, server)
            for fd in fds:
                os.close(fd)
            running.add(pid)
            _send(sock, {"pid": pid})
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                running.clear()
                break
            if pid == 0:
                break
            running.discard(pid)
            _send(sock, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(sys.argv[1:])
