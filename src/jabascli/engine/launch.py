"""The local launcher of ``jabas run``: one ``jabas train`` process per rank on this machine.

Each trainer gets the torch.distributed environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), an equal
share of the CPU threads (``OMP_NUM_THREADS``, unless set), and the write end
of one pipe on which rank 0 reports progress and any rank reports its error
(:mod:`jabascli.engine.events`). Each trainer's output goes to
``<run folder>/logs/rank<R>.log``.

Failures: when a trainer exits with an error, the others are stopped (SIGTERM,
then SIGKILL after a grace period) and :class:`RuntimeFailure` (or
:class:`InputError`, for a trainer's bad-input exit) names that rank and its
error. An interrupt (Ctrl-C) stops every trainer the same way and propagates.
Trainers run in their own sessions, so a terminal's Ctrl-C reaches only this
process, which then stops them in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jabascli.adaptive.checks import check_batching, hand_off_plans
from jabascli.children import Child, log_tail, terminate
from jabascli.config import LoadedConfig
from jabascli.devices import trainer_threads
from jabascli.engine.events import EVENT_FD_ENV
from jabascli.engine.layout import run_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import TrainingPlan, load_plan
from jabascli.engine.trainer_env import TRAINER_ENTRY
from jabascli.errors import InputError, Problem, RuntimeFailure
from jabascli.forkserver import Unavailable, shared_server
from jabascli.net import free_port

PORT_ATTEMPTS = 3
POLL_S = 0.1


@dataclass
class LaunchResult:
    """What the trainers reported: rank 0's ``done`` event, and every event in order."""

    done: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)


def run_local(
    loaded: LoadedConfig,
    options: TrainOptions | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
) -> LaunchResult:
    """Train ``loaded``'s job on this machine: check the inputs, then one trainer per rank of its plan.

    Bad input (the plan, the checkpoint to resume) fails here, before any trainer starts.
    When the trainers fail (not for bad input), they are all restarted, at most
    ``max_restarts`` times, from the latest checkpoint this run wrote (as ``torchrun
    --max-restarts``; see :func:`restarting`).
    """
    options = options or TrainOptions()
    plan = load_plan(loaded, options.plan)
    check_plan_inputs(loaded, plan)
    if options.resume is not None:
        from jabascli.engine.checkpoint import check_resumable
        from jabascli.workload import workload_of

        found = check_resumable(options.resume, workload_of(loaded))
        options = dataclasses.replace(options, resume=found.path)  # every rank resumes this one file
        if on_event is not None:
            for line in found.passed_over:
                on_event({"event": "note", "server": None, "message": f"{line}; resuming from {found.path}"})
    logs = run_folder(loaded) / "logs"
    env = {**(env or {}), **hand_off_plans(loaded, run_folder(loaded))}  # the hybrid plans checked above
    from jabascli.engine.conditions import profile_notes, profiled_threads

    threads = trainer_threads(plan.world_size)
    if not os.environ.get("OMP_NUM_THREADS", "").strip():
        threads = profiled_threads(loaded, plan) or threads  # the plan runs as its servers were profiled
    env["OMP_NUM_THREADS"] = str(threads)
    notes = profile_notes(loaded, plan, threads)
    if on_event is not None:
        for server, note in notes.items():
            on_event({"event": "note", "server": server, "message": note})
    rank_notes = {r.rank: notes[r.server] for r in plan.ranks if r.server in notes}
    if max_restarts == 0:
        return launch_local(loaded.path, plan, options.train_args(), logs, on_event, env, rank_notes)
    from jabascli.engine.layout import checkpoint_folder

    def attempt(resume: Path | None) -> LaunchResult:
        opts = options if resume is None else dataclasses.replace(options, resume=resume)
        return launch_local(loaded.path, plan, opts.train_args(), logs, on_event, env, rank_notes)

    return restarting(attempt, checkpoint_folder(loaded), max_restarts, on_event)


def check_plan_inputs(loaded: LoadedConfig, plan: TrainingPlan) -> None:
    """The checks of a job and its plan that come before any trainer starts (bad input raises)."""
    from jabascli.engine.precision_checks import check_job_precision_inputs

    check_batching(loaded, plan)
    check_job_precision_inputs(loaded, plan)


def restarting(
    attempt: Callable[[Path | None], LaunchResult],
    checkpoints: Path,
    max_restarts: int,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> LaunchResult:
    """Call ``attempt(resume)`` until it succeeds, at most ``1 + max_restarts`` times.

    The first attempt resumes from what the options say; each restart from the
    newest intact checkpoint in the folder ``checkpoints`` if an attempt of this run
    wrote it (its modification time says so), else as the first attempt did.
    Bad input (:class:`InputError`) is never retried.
    """
    from jabascli.engine.checkpoint_store import newest_checkpoint

    started = time.time()
    resume: Path | None = None
    for restarts in range(max_restarts + 1):
        try:
            return attempt(resume)
        except InputError:
            raise
        except RuntimeFailure as exc:
            if restarts == max_restarts:
                raise RuntimeFailure([*exc.lines(), f"gave up after {max_restarts} restarts"]) from None
            with contextlib.suppress(OSError, InputError):
                found = newest_checkpoint(checkpoints)
                if found is not None and found.path.stat().st_mtime >= started:
                    resume = found.path
            if on_event is not None:
                reason = exc.lines()[0] if exc.lines() else "failed"
                on_event({"event": "restart", "restarts": restarts + 1, "reason": reason, "resume": str(resume)})
    raise AssertionError("unreachable")


def launch_local(
    config: Path,
    plan: TrainingPlan,
    train_args: Sequence[str],
    logs: Path,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
    notes: dict[int, str] | None = None,
) -> LaunchResult:
    """Run ``jabas train -c config *train_args`` as every rank of ``plan`` and wait for them.

    Retries with another port when the rendezvous port was taken before rank 0 bound it.
    ``notes``: a line to write at the top of a rank's log, by rank.
    """
    for attempt in range(PORT_ATTEMPTS):
        run = _LocalRun(config, plan, train_args, logs, on_event, env, notes or {})
        try:
            return run.wait()
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise RuntimeFailure.at(None, None, "no free rendezvous port on 127.0.0.1") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


class _LocalRun:
    def __init__(
        self,
        config: Path,
        plan: TrainingPlan,
        train_args: Sequence[str],
        logs: Path,
        on_event: Callable[[dict[str, Any]], None] | None,
        env: dict[str, str] | None,
        notes: dict[int, str],
    ) -> None:
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []  # in arrival order
        self.started = False
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"rank{r}.log" for r in range(plan.world_size)]
        read_fd, write_fd = os.pipe()
        self.read_fd = read_fd
        self.buffer = b""
        base = {**os.environ, **(env or {})}
        threads = trainer_threads(plan.world_size)
        port = free_port()
        argv = ["train", "-c", str(config), *train_args]
        self.procs: list[Child] = []
        try:
            for rank in range(plan.world_size):
                child_env = {
                    **base,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(plan.world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(plan.world_size),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    EVENT_FD_ENV: str(write_fd),
                }
                child_env.setdefault("OMP_NUM_THREADS", str(threads))
                with self.logs[rank].open("wb") as log:
                    if rank in notes:
                        log.write(f"note: {notes[rank]}\n".encode())
                        log.flush()
                    self.procs.append(start_trainer(argv, child_env, log.fileno(), write_fd))
        except BaseException:
            self.stop()
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the children hold it; EOF once they are all gone

    def wait(self) -> LaunchResult:
        try:
            while True:
                self._read_events(POLL_S)
                codes = [p.poll() for p in self.procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    self._read_events(0)  # a failed trainer sends its error before it exits
                    reported = list(self.errors)
                    self.stop()
                    raise self._failure({r: codes[r] for r in failed}, reported)
                if all(c == 0 for c in codes):
                    self._read_events(0)
                    break
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(self.read_fd)
        done = next((e for e in reversed(self.events) if e.get("event") == "done"), None)
        if done is None:
            raise RuntimeFailure.at(None, None, f"the trainers exited without finishing (see {self.logs[0]})")
        return LaunchResult(done, self.events)

    def _read_events(self, timeout: float) -> None:
        ready, _, _ = select.select([self.read_fd], [], [], timeout)
        while ready:
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                return
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                self._dispatch(line)
            ready, _, _ = select.select([self.read_fd], [], [], 0)

    def _dispatch(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        self.events.append(event)
        if event.get("event") == "error":
            self.errors.append(event)
            return
        if event.get("event") == "start":
            self.started = True
        if self.on_event is not None:
            self.on_event(event)

    def stop(self) -> None:
        """SIGTERM every live trainer, then SIGKILL what is left after the grace period."""
        terminate(self.procs)

    def _failure(self, failed: dict[int, int | None], reported: list[dict[str, Any]]) -> Exception:
        """The root cause: a trainer killed by a signal, else the first error reported, else a log tail.

        (When one trainer dies, the others soon fail too, in their collectives.)
        """
        killed = [r for r, code in failed.items() if code is not None and code < 0]
        if reported and not killed:
            error = reported[0]
            rank, message = error.get("rank", "?"), str(error.get("message", ""))
            if not self.started and _port_taken(message):
                return _PortTaken()
            lines = message.splitlines() or [""]
            if error.get("kind") == "input":
                return InputError([Problem(None, None, line) for line in lines])
            if isinstance(rank, int) and 0 <= rank < len(self.logs):
                lines[-1] += f" (log: {self.logs[rank]})"
            return RuntimeFailure([f"trainer rank {rank} failed: {lines[0]}", *lines[1:]])
        rank = killed[0] if killed else min(failed)
        code = failed[rank]
        tail = log_tail(self.logs[rank])
        if not self.started and _port_taken(tail):
            return _PortTaken()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        detail = tail.strip().splitlines()[-1] if tail.strip() else "no output"
        return RuntimeFailure([f"trainer rank {rank} {how}: {detail} (log: {self.logs[rank]})"])


def start_trainer(argv: Sequence[str], env: dict[str, str], output: int, event_fd: int) -> Child:
    """``jabas ARGV`` as a trainer process: forked by this process's fork server (:mod:`jabascli.forkserver`,
    torch already imported), else started fresh. Either way in a session of its own (a terminal's Ctrl-C
    reaches the launcher, which stops the trainers), output to ``output``, ``event_fd`` passed on."""
    try:
        server = shared_server()
        return server.spawn(TRAINER_ENTRY, argv, env, output, (event_fd,), new_session=True, name="jabas-train")
    except Unavailable:
        return subprocess.Popen(
            [sys.executable, "-m", "jabascli", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            pass_fds=(event_fd,),
            start_new_session=True,
        )


def _port_taken(text: str) -> bool:
    text = text.lower()
    return "address already in use" in text or "eaddrinuse" in text
