"""Run one measurement in a child process, so that whatever happens there stays there.

The parent writes a JSON spec to a private temporary folder and starts
``python -m <module> SPEC RESULT``. The child prints progress lines on stdout
(``PROGRESS_PREFIX`` + JSON; anything else a workload prints is ignored),
writes its result as JSON to RESULT and exits. A child that dies without a
result (a segfault, the kernel's OOM killer, a timeout) is reported with its
exit status and the last line it wrote on stderr.

On any exception in the parent, Ctrl-C included, the child is killed before
the exception propagates, and the temporary folder is removed: nothing is
left behind in the profile folders, which only the parent writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "@@jabas-progress "


class ChildCrashed(Exception):
    """The child exited without a result."""

    def __init__(self, returncode: int | None, last_line: str, timed_out: bool = False) -> None:
        self.returncode = returncode
        self.last_line = last_line
        self.timed_out = timed_out
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.timed_out:
            status = "timed out and was killed"
        elif self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            status = f"was killed by {name}"
            if self.returncode == -signal.SIGKILL:
                status += " (the kernel's out-of-memory killer?)"
        else:
            status = f"exited with status {self.returncode}"
        return f"{status}: {self.last_line}" if self.last_line else status


@dataclass
class Child:
    """A started child process and its files."""

    proc: subprocess.Popen[str]
    result_path: Path
    stderr_path: Path


def emit_progress(**fields: Any) -> None:
    """In a child: one progress line for the parent."""
    print(PROGRESS_PREFIX + json.dumps(fields), flush=True)


def run_child(
    module: str,
    spec: dict[str, Any],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``python -m module`` on ``spec``; its result, or :class:`ChildCrashed`."""
    return run_children(module, [spec], on_progress, timeout, [env] if env else None)[0]


def run_children(
    module: str,
    specs: Sequence[dict[str, Any]],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = None,
    envs: Sequence[dict[str, str] | None] | None = None,
) -> list[dict[str, Any]]:
    """Run one child per spec, together; progress is read from the first one.

    When one of them fails, the others are killed (they would otherwise wait
    for it forever in a collective) and :class:`ChildCrashed` is raised for
    the first that failed.
    """
    with tempfile.TemporaryDirectory(prefix="jabas-profile-") as tmp:
        children: list[Child] = []
        timer: threading.Timer | None = None
        timed_out = threading.Event()
        try:
            for i, spec in enumerate(specs):
                children.append(_start(module, spec, Path(tmp), i, (envs or [None] * len(specs))[i]))
            if timeout is not None:

                def expire() -> None:
                    timed_out.set()
                    _kill_all(children)

                timer = threading.Timer(timeout, expire)
                timer.daemon = True
                timer.start()
            _follow(children, on_progress)
            return _collect(children, timed_out.is_set())
        finally:
            if timer is not None:
                timer.cancel()
            _kill_all(children)


def _start(module: str, spec: dict[str, Any], tmp: Path, index: int, env: dict[str, str] | None) -> Child:
    spec_path = tmp / f"spec{index}.json"
    result_path = tmp / f"result{index}.json"
    stderr_path = tmp / f"stderr{index}.txt"
    spec_path.write_text(json.dumps(spec, default=str), encoding="utf-8")
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(spec_path), str(result_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            encoding="utf-8",
            errors="replace",
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return Child(proc, result_path, stderr_path)


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the profiler dies, however it dies."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _follow(children: list[Child], on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    """Read the first child's progress until it exits; watch the others in threads.

    A child that fails takes its siblings down with it: they would otherwise
    wait for it forever in a collective operation.
    """
    watchers = [threading.Thread(target=_watch, args=(c, children), daemon=True) for c in children[1:]]
    for thread in watchers:
        thread.start()
    first = children[0].proc
    assert first.stdout is not None
    for line in first.stdout:
        if on_progress is None or not line.startswith(PROGRESS_PREFIX):
            continue
        try:
            fields = json.loads(line[len(PROGRESS_PREFIX) :])
        except json.JSONDecodeError:
            continue
        on_progress(fields)
    if first.wait() != 0:
        _kill_all(children[1:])
    for thread in watchers:
        thread.join()


def _watch(child: Child, children: list[Child]) -> None:
    assert child.proc.stdout is not None
    for _ in child.proc.stdout:
        pass
    if child.proc.wait() != 0:
        _kill_all([c for c in children if c is not child])


def _collect(children: list[Child], timed_out: bool) -> list[dict[str, Any]]:
    results = []
    crashes = []
    for child in children:
        result = _read_result(child.result_path)
        if result is not None and child.proc.returncode == 0:
            results.append(result)
        else:
            # A child that failed cleanly says why in its result; one that died, on stderr.
            said = result.get("error") if result is not None else None
            crashes.append(ChildCrashed(child.proc.returncode, said or _last_line(child.stderr_path), timed_out))
    if crashes:
        # A child killed because another failed says little; report the one that failed first.
        crashes.sort(key=lambda c: c.returncode == -signal.SIGKILL)
        raise crashes[0]
    return results


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return result if isinstance(result, dict) else None


def _kill_all(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process stuck in the kernel
            child.proc.wait(timeout=30)


def _last_line(path: Path) -> str:
    """The last meaningful line a child wrote on stderr (usually the exception)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if line and not line.startswith(("warnings.warn", "File ")) and "Warning" not in line:
            return line
    return ""
