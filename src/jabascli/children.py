"""Child processes that end with their parent: the kernel kills them when it dies (Linux).

A trainer dies with its agent, an agent and the scheduler with ``jabas run``, a
profiler's child with the profiler, so that no process of a job outlives what
started it, even when that is killed outright. ``prctl(PR_SET_PDEATHSIG)`` is
set between fork and exec (``preexec_fn=die_with_parent``); libc is loaded
here, at import, since nothing should be loaded in that window. Elsewhere than
Linux :data:`PREEXEC` is None and children are ended the ordinary way.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1


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
