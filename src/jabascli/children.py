"""Child processes that end with their parent, and how a parent ends them.

They end with their parent: the kernel kills them when it dies (Linux).

A trainer dies with its agent, an agent and the scheduler with ``jabas run``, a
profiler's child with the profiler, so that no process of a job outlives what
started it, even when that is killed outright. ``prctl(PR_SET_PDEATHSIG)`` is
set between fork and exec (``preexec_fn=die_with_parent``); libc is loaded
here, at import, since nothing should be loaded in that window. Elsewhere than
Linux :data:`PREEXEC` is None and children are ended the ordinary way.

A parent that ends them on purpose sends SIGTERM and, :data:`GRACE_S` later, SIGKILL (:func:`terminate`).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

_PR_SET_PDEATHSIG = 1
GRACE_S = 5.0
"""How long a child has to end after SIGTERM before it is killed."""


def _load_libc() -> Any:
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have the kernel SIGKILL this process when the thread that started it ends."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


PREEXEC: Callable[[], None] | None = die_with_parent if _LIBC is not None else None
"""``preexec_fn`` for a child that dies with its parent (None where that cannot be had)."""


class Child(Protocol):
    """What a parent needs of a child: a :class:`subprocess.Popen`, or one a fork server forked."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def terminate(procs: Sequence[Child], send: Callable[[Child, int], None] | None = None) -> None:
    """SIGTERM every live process of ``procs``, then SIGKILL what is left after :data:`GRACE_S`.

    ``send`` delivers a signal (default: to the process alone; the elastic agent
    passes one that signals the trainer's whole process group).
    """
    send = send or _signal
    live = [p for p in procs if p.poll() is None]
    for p in live:
        send(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()


def _signal(proc: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def log_tail(path: Path, size: int = 4000) -> str:
    """The last ``size`` bytes of a child's log, as text (empty if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(path.stat().st_size - size, 0))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
