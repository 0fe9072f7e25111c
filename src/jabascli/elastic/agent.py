"""The worker agent (``jabas worker``): one per node, it runs the trainers the scheduler asks for.

Loop: read the trainers' progress events (a pipe, as ``jabas run`` does), reap
exited trainers, and every ``heartbeat_interval_s`` (at once when a trainer
exited) send a :class:`Heartbeat`; its reply's commands are applied:

* ``start``: write the plan file, then one ``jabas train`` per rank, as an
  argument list (never a shell), with the torch.distributed environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
  in a session of its own, killed by the kernel if this agent dies
  (``PR_SET_PDEATHSIG``), and without the token in its environment. Each
  trainer is forked from this node's warm trainer server
  (:mod:`jabascli.cli.spare`, started when the agent registers and kept), so a
  move does not wait for a new interpreter to import torch. A start that comes
  while the server still imports waits for it (heartbeats go on), for at most
  :data:`WARM_WAIT_S`: trainers started fresh beside it would import torch a
  second time on the node, on the same cores;
* ``stop`` ``epoch``/``now``: write the request into rank 0's control file
  (:mod:`jabascli.engine.control`): the trainers checkpoint and exit 0; with a
  *handoff* (a move in place, :mod:`jabascli.engine.handoff`) those that stay
  carry on into the next generation instead, and say so with a ``handoff``
  event, after which this agent counts them (their events, their exit) as
  ranks of that generation;
* ``stop`` ``kill``: SIGTERM the process groups this agent started (never
  anything found by name), SIGKILL after :data:`GRACE_S`.

Every exit is reported with its code and the tail of the trainer's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jabascli.atomic import atomic_write_json, atomic_write_text
from jabascli.children import GRACE_S, PREEXEC, Child, log_tail, terminate
from jabascli.config import LoadedConfig
from jabascli.devices import detect_devices, trainer_threads
from jabascli.elastic.client import Rejected, SchedulerClient, Unreachable
from jabascli.elastic.protocol import (
    Commands,
    DeviceInfo,
    Heartbeat,
    Registration,
    RunningTrainer,
    StartCommand,
    StopCommand,
    TrainerEvent,
    TrainerExit,
    finite_only,
)
from jabascli.elastic.token import TOKEN_ENV
from jabascli.elastic.warm import WarmServer
from jabascli.engine.events import EVENT_FD_ENV
from jabascli.engine.layout import checkpoint_folder, run_folder
from jabascli.engine.trainer_env import (
    CONTROL_FILE_ENV,
    GENERATION_ENV,
)
from jabascli.errors import InputError, RuntimeFailure

EXITING_S = 0.5
"""How long to wait for a trainer that closed its event pipe to exit."""
WARM_WAIT_S = 60.0
"""The longest a start waits for the warm server still importing; then its trainers start fresh."""
WARM_POLL_S = 0.05
"""How often the loop looks at the importing server while a start waits for it."""

LOG_TAIL = 4000
URGENT_S, URGENT_FOR_S = 0.01, 5.0
"""After a trainer's ``peer_lost`` (engine/recovery.py), heartbeats every URGENT_S for at most URGENT_FOR_S, or
until it hands over: the recovery order comes in a heartbeat's reply."""
ORDER_WAIT_S = 0.25
"""Once every trainer here waits for its recovery order (nothing else will come from them), a heartbeat asks the
scheduler to hold its reply this long: the order comes back the moment it is decided."""
BACKOFF_S = (0.2, 5.0)
"""First and largest wait between attempts to reach the scheduler."""


def check_writable(folder: Path) -> None:
    """InputError unless a file can be created in ``folder`` (made if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jabas-probe-"):
            pass
    except OSError as exc:
        raise InputError.at(folder, None, f"checkpoint folder is not writable: {exc.strerror or exc}") from None


@dataclass
class Trainer:
    generation: int
    rank: int
    proc: Child
    log: Path
    read_fd: int
    buffer: bytes = b""
    kill_at: float | None = None
    reported: bool = False
    awaits_order: bool = False
    """It lost a peer and waits for its recovery order (until it hands over)."""


@dataclass
class Run:
    """The trainers of one generation on this node."""

    generation: int
    trainers: list[Trainer]
    control: Path | None


class WorkerAgent:
    def __init__(
        self,
        loaded: LoadedConfig,
        rank: int,
        client: SchedulerClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loaded, self.rank, self.client, self.clock = loaded, rank, client, clock
        cfg = loaded.config.scheduler
        self.interval, self.connect_timeout = cfg.heartbeat_interval_s, cfg.connect_timeout_s
        self.folder = run_folder(loaded) / "elastic" / f"worker{rank}"
        self.runs: list[Run] = []
        self.pending_events: list[TrainerEvent] = []
        self.pending_exits: list[TrainerExit] = []
        self.warm = WarmServer(loaded, rank, _environment(), clock)
        self.waiting: list[tuple[StartCommand, float]] = []
        """Starts waiting for the warm server to finish importing, each with its deadline."""
        self.urgent_until = 0.0
        """Until then, heartbeats every URGENT_S: a trainer here lost a peer and waits for its recovery order."""
        self.devices = loaded.config.cluster.servers[rank].devices if rank < len(loaded.config.cluster.servers) else 0

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Register, then follow the scheduler until it says the job is over."""
        servers = self.loaded.config.cluster.servers
        if not 0 <= self.rank < len(servers):
            raise InputError.at(
                self.loaded.path, "cluster.servers", f"--rank {self.rank}: the config has {len(servers)} servers"
            )
        check_writable(checkpoint_folder(self.loaded))
        self.folder.mkdir(parents=True, exist_ok=True)
        self._retrying(self._register)
        last_ok = self.clock()
        next_beat = 0.0
        try:
            while True:
                wait = min(next_beat - self.clock(), self.interval)
                self._read_events(max(0.0, min(wait, WARM_POLL_S) if self.waiting else wait))
                exited = self._reap()
                if self.clock() < self.urgent_until:
                    next_beat = min(next_beat, last_ok + URGENT_S)
                self.warm.keep()
                self._start_waiting()
                if self.clock() < next_beat and not exited:
                    continue
                try:
                    reply = self.client.heartbeat(self.rank, self._beat())
                except Unreachable:
                    if self.clock() - last_ok > self.connect_timeout:
                        raise RuntimeFailure.at(
                            None, None, f"scheduler {self.client.address} unreachable for {self.connect_timeout:g} s"
                        ) from None
                    next_beat = self.clock() + self.interval
                    continue
                except Rejected as exc:
                    if exc.status != 409:
                        raise
                    # Declared lost (we were silent too long): our ranks were restarted elsewhere.
                    self._kill_all()
                    self.runs, self.pending_events, self.pending_exits = [], [], []
                    self._retrying(self._register)
                    continue
                last_ok = self.clock()
                self.pending_events, self.pending_exits = [], []
                next_beat = last_ok + (URGENT_S if self.clock() < self.urgent_until else self.interval)
                self._apply(reply)
                if reply.shutdown:
                    return
        finally:
            self._kill_all()

    def _register(self) -> None:
        found = detect_devices()
        devices = DeviceInfo(
            backend=found.backend, device_type=found.device_type, count=found.count, memory_bytes=found.memory_bytes
        )
        registered = self.client.register(
            Registration(rank=self.rank, host=socket.gethostname() or "?", devices=devices, pid=os.getpid())
        )
        self.server = registered.server
        self.warm.cpu = found.backend == "cpu"
        self.interval = registered.heartbeat_interval_s

    def _retrying(self, call: Callable[[], None]) -> None:
        """Retry an unreachable scheduler with exponential backoff, for ``connect_timeout_s``."""
        deadline = self.clock() + self.connect_timeout
        wait = BACKOFF_S[0]
        while True:
            try:
                return call()
            except Unreachable:
                if self.clock() + wait > deadline:
                    raise RuntimeFailure.at(
                        None, None, f"scheduler {self.client.address} unreachable for {self.connect_timeout:g} s"
                    ) from None
                time.sleep(wait)
                wait = min(wait * 2, BACKOFF_S[1])

    def _beat(self) -> Heartbeat:
        live = [t for r in self.runs for t in r.trainers if t.proc.poll() is None]
        waiting = bool(live) and all(t.awaits_order for t in live)
        return Heartbeat(
            running=[RunningTrainer(generation=t.generation, rank=t.rank, pid=t.proc.pid) for t in live],
            events=list(self.pending_events),
            exits=list(self.pending_exits),
            wait_s=ORDER_WAIT_S if waiting else 0.0,
        )

    # -- commands ----------------------------------------------------------------------------------

    def _apply(self, reply: Commands) -> None:
        for command in reply.commands:
            if isinstance(command, StartCommand):
                if self.warm.importing():
                    self.waiting.append((command, self.clock() + WARM_WAIT_S))
                else:
                    self._start(command)
            elif isinstance(command, StopCommand):
                self._start_waiting(generation=command.generation)  # a stop finds the trainers it stops
                self._stop(command)

    def _start_waiting(self, generation: int | None = None) -> None:
        """Start the waiting starts once the warm server is ready (or gone, or past their deadline), in order;
        ``generation``'s, and those before it, now."""
        if not self.waiting:
            return
        ready = not self.warm.importing()
        while self.waiting:
            command, deadline = self.waiting[0]
            now = generation is not None and command.generation <= generation
            if not (ready or now or self.clock() >= deadline):
                return
            self.waiting.pop(0)
            self._start(command)

    def _start(self, command: StartCommand) -> None:
        gen = command.generation
        self.warm.last_start = self.clock()
        plan_file = self.folder / f"plan-g{gen}.json"
        atomic_write_json(plan_file, command.plan, indent=2)
        control = self.folder / f"control-g{gen}" if 0 in command.ranks else None
        if control is not None:  # an earlier scheduler of this job numbered its generations from 1 too: its
            control.unlink(missing_ok=True)  # last stop stays in the file rank 0 obeyed, and would stop this one
        logs = run_folder(self.loaded) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        argv = ["train", "-c", str(self.loaded.path), "--plan", str(plan_file)]
        if command.resume:
            argv += ["--resume", str(checkpoint_folder(self.loaded))]
        if command.checkpoint_every is not None:
            argv += ["--checkpoint-every", str(command.checkpoint_every)]
        threads = trainer_threads(len(command.ranks))  # this node's cores, shared among its trainers
        trainers: list[Trainer] = []
        try:
            for local, rank in enumerate(command.ranks):
                env = {
                    **_environment(),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(command.world_size),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(len(command.ranks)),
                    "MASTER_ADDR": command.master_addr,
                    "MASTER_PORT": str(command.master_port),
                    GENERATION_ENV: str(gen),
                }
                env.setdefault("OMP_NUM_THREADS", str(threads))
                if rank == 0 and control is not None:
                    env[CONTROL_FILE_ENV] = str(control)
                log = logs / f"g{gen}-rank{rank}.log"
                proc, read_fd = self.warm.fork(argv, env, log) or self._spawn(
                    [sys.executable, "-m", "jabascli", *argv], env, log
                )
                trainers.append(Trainer(gen, rank, proc, log, read_fd))
        except OSError as exc:
            for t in trainers:
                _signal_group(t.proc, signal.SIGKILL)
            raise RuntimeFailure.at(None, None, f"cannot start a trainer: {exc}") from None
        self.runs.append(Run(gen, trainers, control))

    def _spawn(self, args: list[str], env: dict[str, str], log: Path) -> tuple[Child, int]:
        """A fresh trainer in its own session, killed with this agent, with an event pipe; never through a shell."""
        read_fd, write_fd = os.pipe()
        env = {**env, EVENT_FD_ENV: str(write_fd)}
        try:
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    args,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                    preexec_fn=PREEXEC,
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child holds it: EOF once it is gone
        return proc, read_fd

    def _stop(self, command: StopCommand) -> None:
        for run in self.runs:
            if run.generation != command.generation:
                continue
            if command.when == "kill":
                deadline = self.clock() + GRACE_S
                for t in run.trainers:
                    if t.proc.poll() is None:
                        _signal_group(t.proc, signal.SIGTERM)
                        t.kill_at = deadline
            elif run.control is not None and command.handoff is not None:
                if command.when == "recover":  # the order has come: nothing more to wait for
                    for t in run.trainers:
                        t.awaits_order = False
                request = {"when": command.when, "handoff": command.handoff.model_dump()}
                atomic_write_text(run.control, json.dumps(request), durable=False)  # read at once, or never
            elif run.control is not None:
                atomic_write_text(run.control, command.when, durable=False)

    # -- trainers ----------------------------------------------------------------------------------

    def _read_events(self, timeout: float) -> None:
        trainers = {t.read_fd: (run, t) for run in self.runs for t in run.trainers if t.read_fd >= 0}
        if not trainers:
            time.sleep(timeout)
            return
        ready, _, _ = select.select(list(trainers), [], [], timeout)
        for fd in ready:
            run, t = trainers[fd]
            chunk = os.read(fd, 65536)
            if not chunk:  # the trainer closed its end: it is exiting; report it at once
                os.close(fd)
                t.read_fd = -1
                with contextlib.suppress(subprocess.TimeoutExpired):
                    t.proc.wait(EXITING_S)
                continue
            t.buffer += chunk
            *lines, t.buffer = t.buffer.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        if event.get("event") == "handoff":
                            run = self._handed_over(run, t, event)
                            self.urgent_until, t.awaits_order = 0.0, False
                        elif event.get("event") == "peer_lost":  # its order is on the way: fetch it soon
                            self.urgent_until = self.clock() + URGENT_FOR_S
                            t.awaits_order = event.get("in_place") is not False  # False: it exits instead
                        self.pending_events.append(TrainerEvent(generation=run.generation, event=finite_only(event)))

    def _handed_over(self, run: Run, t: Trainer, event: dict[str, object]) -> Run:
        """Trainer ``t`` of ``run`` carries on as a rank of the next generation: count it there."""
        generation, rank = event.get("generation"), event.get("rank")
        if not isinstance(generation, int) or not isinstance(rank, int):
            return run
        run.trainers.remove(t)
        t.generation, t.rank = generation, rank
        nxt = next((r for r in self.runs if r.generation == generation), None)
        if nxt is None:
            nxt = Run(generation, [], None)
            self.runs.append(nxt)
        nxt.trainers.append(t)
        if rank == 0:
            nxt.control = run.control  # rank 0 keeps the control file its environment names
        return nxt

    def _reap(self) -> bool:
        """Report trainers that exited; SIGKILL those past their grace period. True if any exited."""
        exited = False
        now = self.clock()
        for run in self.runs:
            for t in run.trainers:
                code = t.proc.poll()
                if code is None:
                    if t.kill_at is not None and now >= t.kill_at:
                        _signal_group(t.proc, signal.SIGKILL)
                    continue
                if not t.reported:
                    t.reported = exited = True
                    self.pending_exits.append(
                        TrainerExit(generation=t.generation, rank=t.rank, code=code, log_tail=log_tail(t.log, LOG_TAIL))
                    )
        if exited:
            self._read_events(0)  # a failing trainer's error event precedes its exit
        self.runs = [r for r in self.runs if not all(t.reported and t.read_fd < 0 for t in r.trainers)]
        return exited

    def _kill_all(self) -> None:
        terminate([t.proc for r in self.runs for t in r.trainers], _signal_group)
        for r in self.runs:
            for t in r.trainers:
                if t.read_fd >= 0:
                    os.close(t.read_fd)
                    t.read_fd = -1
        self.warm.close()  # after its trainers: they would die with it, without their SIGTERM's grace


def _environment() -> dict[str, str]:
    """This agent's environment without the token: trainers never need the secret."""
    return {k: v for k, v in os.environ.items() if k != TOKEN_ENV}


def _signal_group(proc: Child, sig: int) -> None:
    """Signal the process group of a trainer this agent started (its own session: pgid == pid).

    Only while it has not been reaped, so the id cannot belong to another process yet.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
