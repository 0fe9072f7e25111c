"""Run one measurement in a child process, so that whatever happens there stays there.

The parent writes a JSON spec to a private temporary folder and runs
``<module>.main([SPEC, RESULT])`` in a child process. The child's stdout and
stderr go to a log file in that folder; the parent follows it for progress
lines (``PROGRESS_PREFIX`` + JSON; anything else a workload prints is kept
for the error report) while it waits. The child writes its result as JSON to
RESULT and exits 0, or 1 with the error it reports (:mod:`.worker`). A child
that dies without a result (a segfault, the kernel's OOM killer, a timeout) is
reported with its exit status and the last line of its log.

Children are started in one of two ways:

- *fresh*: ``python -m <module> SPEC RESULT``, a new interpreter. Always used
  for CUDA work (a CUDA context must never be inherited) and for the
  processes of an all-reduce measurement, which run together.
- *forked* (Linux, CPU work) from the profiler's fork server
  (:mod:`jabascli.forkserver`, :data:`TRIAL_PRELOAD`), which imported torch
  once and forks a child per run. Importing torch and ``torch._dynamo`` (which
  every training step pulls in) takes seconds, more than a small trial itself.
  The child is still a process of its own: the server never runs a model, and
  a crash or a leak stays in the child. Set ``JABAS_PROFILE_FRESH=1`` to start
  every child fresh.

Every child dies with the profiler (Linux's parent-death signal), and on any
exception in the parent, Ctrl-C included, the children are killed before the
exception propagates and the temporary folder is removed: nothing is left in
the profile folders, which only the parent writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from jabascli.children import PREEXEC
from jabascli.forkserver import Unavailable, shared_server, start_shared_server

PROGRESS_PREFIX = "@@jabas-progress "
FRESH_ENV = "JABAS_PROFILE_FRESH"
"""Set (to anything): every child is a fresh interpreter, none is forked."""
TRIAL_PRELOAD = ("torch", "torch._dynamo", "jabascli.profiler.trial", "jabascli.workload")
"""What the fork server of measurements imports once: a training step pulls in ``torch._dynamo``."""
POLL_SECONDS = 0.05


class ChildCrashed(Exception):
    """The child exited without a result."""

    def __init__(self, returncode: int | None, last_line: str, timed_out: bool = False, reported: bool = False) -> None:
        self.returncode = returncode
        self.last_line = last_line
        self.timed_out = timed_out
        self.reported = reported
        """The child wrote why it failed (``last_line``) in its result (:mod:`.worker`)."""
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.reported and not self.timed_out:
            return self.last_line
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


def emit_progress(**fields: Any) -> None:
    """In a child: one progress line for the parent."""
    print(PROGRESS_PREFIX + json.dumps(fields), flush=True)


class _Process(Protocol):
    def poll(self) -> int | None: ...
    def kill(self) -> None: ...


def run_child(
    module: str,
    spec: dict[str, Any],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Run ``module.main([SPEC, RESULT])`` in a child; its result, or :class:`ChildCrashed`.

    ``fresh``, or a spec whose ``device`` is ``cuda``, starts a new interpreter.
    """
    fresh = fresh or spec.get("device") == "cuda" or bool(os.environ.get(FRESH_ENV))
    return _run(module, [spec], on_progress, timeout, forked=not fresh and sys.platform == "linux")[0]


def run_children(
    module: str,
    specs: Sequence[dict[str, Any]],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Run one fresh child per spec, together; progress is read from the first one.

    When one of them fails, the others are killed (they would otherwise wait
    for it forever in a collective) and :class:`ChildCrashed` is raised for
    the one that failed first.
    """
    return _run(module, specs, on_progress, timeout, forked=False)


PORT_ATTEMPTS = 3


def port_taken(crash: ChildCrashed) -> bool:
    """The group's rendezvous port was in use (taken by another program since it was picked)."""
    return "address already in use" in crash.describe().lower()


def run_group(
    module: str,
    specs_at: Callable[[int], Sequence[dict[str, Any]]],
    port: int | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = None,
    on_new_port: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """:func:`run_children` for the processes of one group meeting at ``port`` (None: a free one), their specs
    ``specs_at(port)``. While the port turns out to be in use, up to :data:`PORT_ATTEMPTS` tries, the group
    meets at another free port (``on_new_port(port)`` is told which); then :class:`ChildCrashed` of the last try.
    ``on_new_port`` None and ``port`` given: the port is someone else's choice, and is not changed.
    """
    from jabascli.net import free_port

    movable = port is None or on_new_port is not None
    port = free_port() if port is None else port
    for attempt in range(PORT_ATTEMPTS):
        try:
            return run_children(module, specs_at(port), on_progress, timeout)
        except ChildCrashed as crash:
            if not (movable and port_taken(crash)) or attempt == PORT_ATTEMPTS - 1:
                raise
            port = free_port()
            if on_new_port is not None:
                on_new_port(port)
    raise AssertionError("unreachable")


def _run(
    module: str,
    specs: Sequence[dict[str, Any]],
    on_progress: Callable[[dict[str, Any]], None] | None,
    timeout: float | None,
    forked: bool,
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="jabas-profile-") as tmp:
        folder = Path(tmp)
        procs: list[_Process] = []
        try:
            for i, spec in enumerate(specs):
                spec_path, result_path, log_path = (folder / f"{name}{i}" for name in ("spec", "result", "log"))
                spec_path.write_text(json.dumps(spec, default=str), encoding="utf-8")
                args = [str(spec_path), str(result_path)]
                procs.append(_fork(module, args, log_path) if forked else _start(module, args, log_path))
            timed_out = _follow(procs, folder / "log0", on_progress, timeout)
            return _collect(folder, procs, timed_out)
        finally:
            _kill_all(procs)


def prepare_forked_children() -> None:
    """Start the fork server of this process's measurements now: called by a profiler command while it runs one
    Python thread (before its progress display or lifeline starts one), the server is forked from it."""
    if sys.platform == "linux" and not os.environ.get(FRESH_ENV):
        start_shared_server(TRIAL_PRELOAD)


def _fork(module: str, args: list[str], log_path: Path) -> _Process:
    """A child forked by this process's fork server (:mod:`jabascli.forkserver`); a fresh one without it."""
    try:
        server = shared_server(TRIAL_PRELOAD)
        with open(log_path, "wb") as log:
            return server.spawn(f"{module}:main", args, os.environ, log.fileno(), name="jabas-profile")
    except Unavailable:
        return _start(module, args, log_path)


def _start(module: str, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=PREEXEC,
        )


def _follow(
    procs: list[_Process],
    log_path: Path,
    on_progress: Callable[[dict[str, Any]], None] | None,
    timeout: float | None,
) -> bool:
    """Relay the first child's progress until every child has exited; True if time ran out.

    A child that fails takes its siblings down with it: they would otherwise
    wait for it forever in a collective operation.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with _LogFollower(log_path) as log:
        while True:
            codes = [p.poll() for p in procs]
            for line in log.new_lines():
                if on_progress is not None and line.startswith(PROGRESS_PREFIX):
                    with contextlib.suppress(json.JSONDecodeError):
                        on_progress(json.loads(line[len(PROGRESS_PREFIX) :]))
            if all(code is not None for code in codes):
                return False
            if any(code not in (None, 0) for code in codes):
                _kill_all(procs)
            if deadline is not None and time.monotonic() > deadline:
                _kill_all(procs)
                return True
            time.sleep(POLL_SECONDS)


class _LogFollower:
    """Complete lines appended to a file since the last look."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: IO[bytes] | None = None
        self.partial = b""

    def __enter__(self) -> _LogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()

    def new_lines(self) -> list[str]:
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 - kept open across calls, closed in __exit__
            except FileNotFoundError:
                return []
        data = self.partial + self.file.read()
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


def _collect(folder: Path, procs: list[_Process], timed_out: bool) -> list[dict[str, Any]]:
    results = []
    crashes = []
    for i, proc in enumerate(procs):
        code = proc.poll()
        result = _read_result(folder / f"result{i}")
        if result is not None and code == 0:
            results.append(result)
        else:
            # A child that failed cleanly says why in its result; one that died, in its log.
            said = result.get("error") if result is not None else None
            crashes.append(ChildCrashed(code, said or _last_line(folder / f"log{i}"), timed_out, reported=bool(said)))
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


def _kill_all(procs: Sequence[_Process]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)


def _last_line(path: Path) -> str:
    """The last meaningful line a child wrote (usually the exception)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if not line or line.startswith((PROGRESS_PREFIX.strip(), "File ", "warnings.warn")) or "Warning" in line:
            continue
        return line
    return ""
