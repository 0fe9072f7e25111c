"""The scheduler's state: workers, the job, and the decisions that start, move and restart it.

A job runs as a sequence of *generations*: one set of trainer ranks, on one
allocation (a list of servers), with one plan, started from the job's latest
checkpoint (or from scratch). A generation ends when all its ranks have exited;
what follows depends on why::

    waiting --(all servers of the allocation registered)--> running
    running --move(servers, when)--> moving --(all ranks exit 0)--> running   (new generation)
    running --move in place--> moving --(first iteration of the new generation)--> running
    running/moving --(a rank exits != 0, or its worker misses heartbeats)--> restarting
    restarting --(every rank gone)--> running on the live servers, from the checkpoint
                                      (failed after max_restarts)
    running --(rank 0 done, every rank exit 0)--> succeeded
    any --stop(when)--> stopping --(every rank gone)--> stopped

A move *in place* (when the new allocation keeps rank 0's server; see
:mod:`jabascli.engine.handoff`) starts the new generation at once: the stop
request carries it to the trainers, those that stay carry on into it, new ranks
(*joiners*) are started ahead and wait for them. Until the new generation's
first iteration, the old one is *retiring*: its events still count (the last
iteration, the checkpoint), its leavers exit 0, and a survivor that exits
before it handed over counts as its new rank's exit.

Every method is called under :attr:`Scheduler.lock` (the HTTP handlers and the
heartbeat watchdog run on different threads); time comes from ``clock`` so that
the logic can be tested without waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jabascli.config import LoadedConfig
from jabascli.elastic.generations import Generation, Retiring, Worker, handoff, record_exit
from jabascli.elastic.plans import check_allocation, plan_for, survivors
from jabascli.elastic.progress import Progress, event_float, event_int
from jabascli.elastic.protocol import (
    Commands,
    Handoff,
    Heartbeat,
    JobState,
    JobStatus,
    MoveReason,
    MoveRecord,
    Registered,
    Registration,
    StopCommand,
    When,
)
from jabascli.elastic.recovery import Failures
from jabascli.engine.layout import checkpoint_folder, checkpoint_store
from jabascli.engine.plan import TrainingPlan, load_plan, plan_from_solver
from jabascli.errors import InputError, JabasError
from jabascli.net import free_port

TERMINAL: tuple[JobState, ...] = ("succeeded", "failed", "stopped")


Planner = Callable[[JobStatus], "tuple[list[str], When] | None"]
"""Called at every epoch end with the job's status (``epoch_history`` holds every epoch's GBS, servers and
throughput); returns the allocation to move to and when, or None to stay. An auto-scaling planner plugs in here
(:class:`jabascli.elastic.autoscaling.AutoScaler`); its ``last`` attribute, if any, is shown in the status."""


class Conflict(Exception):
    """A request that contradicts the scheduler's state (HTTP 409)."""


class Scheduler:
    """Tracks the workers and the job; every public method is one step of the state machine."""

    def __init__(
        self,
        loaded: LoadedConfig,
        clock: Callable[[], float] = time.monotonic,
        planner: Planner | None = None,
        resume: bool = False,
        servers: str | None = None,
    ) -> None:
        """``resume``: start from the job's existing checkpoint (after the scheduler itself was lost).
        ``servers``: the servers of the first plan, as ``jabas run --servers`` (auto, all, or a,b)."""
        from jabascli.solver.autoplan import solve_for_run

        self.loaded, self.clock, self.planner = loaded, clock, planner
        cfg = loaded.config
        self.servers = [s.name for s in cfg.cluster.servers]
        self.lock = threading.RLock()
        self.workers: dict[int, Worker] = {}
        self.state: JobState = "waiting"
        self.allocation = [s.name for s in cfg.available()]
        self.first = solve_for_run(loaded, None, cfg.job.plan is not None, servers)
        """The first generation's plan, planned as ``jabas run`` plans the same config (None: the plan file's, or
        the configured VSW/GA); its servers are the first allocation."""
        if self.first is not None:
            self.allocation = self.first.plan.servers()
        self.pending: list[str] | None = None
        self.pending_when: When = "epoch"
        self.generation: Generation | None = None
        self.retiring: Retiring | None = None
        self.generations = 0
        self.restarts = 0
        self.max_restarts = cfg.scheduler.max_restarts
        self.checkpoint: Path | None = checkpoint_folder(loaded) if resume else None
        """The job's checkpoint folder, once a trainer of this scheduler reported writing it (or, resuming, at once)."""
        self.progress = Progress()
        self.message = ""
        self.moves: list[MoveRecord] = []
        self.stopping: When | None = None
        self.master_addr: str | None = None
        """Where trainers rendezvous; None: the host of the allocation's first server."""
        self.finished_at: float | None = None
        self.failures = Failures(self)
        """Lost ranks and nodes: recovered in place, or restarted from the checkpoint (elastic/recovery.py)."""

    # -- workers -----------------------------------------------------------------------------------

    def register(self, reg: Registration) -> Registered:
        if reg.rank >= len(self.servers):
            raise InputError.at(
                None, "rank", f"rank {reg.rank} has no server: [[cluster.servers]] has {len(self.servers)} entries"
            )
        known = self.workers.get(reg.rank)
        if known is not None and known.alive:
            raise Conflict(f"worker rank {reg.rank} ({known.server}) is already registered from {known.host}")
        server = self.servers[reg.rank]
        self.workers[reg.rank] = Worker(reg.rank, server, reg.host, self.clock())
        self.message = f"worker {reg.rank} ({server}) registered from {reg.host}"
        self._advance()
        self.failures.take_back()  # a server a recovery left out is back
        return Registered(server=server, heartbeat_interval_s=self.loaded.config.scheduler.heartbeat_interval_s)

    def heartbeat(self, rank: int, beat: Heartbeat) -> Commands:
        worker = self.workers.get(rank)
        if worker is None or not worker.alive:
            raise Conflict(f"worker rank {rank} is not registered (or was declared lost): register again")
        worker.last_seen = self.clock()
        gen = self.generation
        if gen is not None:
            for t in beat.running:
                if t.generation == gen.number and t.rank in gen.ranks_on.get(worker.server, []):
                    gen.running[t.rank] = t
        for item in beat.events:
            if gen is not None and item.generation == gen.number:
                self._on_event(gen, item.event)
            elif self.retiring is not None and item.generation == self.retiring.generation.number:
                self._on_event(self.retiring.generation, item.event)
        for ex in beat.exits:
            if record_exit(self.generation, self.retiring, ex.generation, ex.rank, ex.code) and ex.code != 0:
                tail = ex.log_tail.strip().splitlines()
                why = f"trainer rank {ex.rank} on {worker.server} exited with code {ex.code}"
                self._fail(why, tail, (ex.generation, {ex.rank}))
        self._advance()
        return self.commands_for(rank)

    def deciding(self) -> bool:
        """A failure was seen and is not decided yet: a recovery order may be on its way (a heartbeat is held
        only then)."""
        return self.failures.pending is not None

    def has_commands(self, rank: int) -> bool:
        """A command waits for worker ``rank``, or the job is over (what a held heartbeat waits for)."""
        worker = self.workers.get(rank)
        return self.state in TERMINAL or (worker is not None and bool(worker.commands))

    def commands_for(self, rank: int) -> Commands:
        """The commands waiting for worker ``rank`` (handed over once), and whether the job is over."""
        worker = self.workers[rank]
        worker.last_seen = self.clock()  # a held heartbeat: its agent was there all along
        commands, worker.commands = worker.commands, []
        return Commands(commands=commands, shutdown=self.state in TERMINAL)

    def check_heartbeats(self) -> None:
        """Declare lost every worker silent for ``heartbeat_timeout_s`` (their ranks count as killed), and decide
        a failure whose time is up (elastic/recovery.py)."""
        self.failures.silent_workers()
        self.failures.decide()  # a hung rank: lost once the others have reported their failed collective
        self._advance()

    # -- steering: the entry points of `jabas job` and of an auto-scaling planner --------------------

    def move(self, servers: list[str], when: When = "epoch") -> JobStatus:
        """Move the job to ``servers`` at the next epoch end (or iteration boundary, ``now``).

        Unknown servers are an InputError naming them; the running job is not touched then.
        """
        check_allocation(servers, self.servers)
        if self.state in TERMINAL or self.stopping is not None:
            raise Conflict(f"the job is {self.state}")
        if self.retiring is not None and servers != self.allocation:
            raise Conflict(f"a move to {', '.join(self.allocation)} is under way: move again once it is done")
        # A server that cannot run it fails here, before anything changes (a hybrid plan: at the job's GBS).
        plan_for(self.loaded, servers, self.progress.gbs if self.loaded.config.hybrid_auto else None)
        self.pending, self.pending_when = list(servers), when
        self.message = f"moving to {', '.join(servers)} at the next {'epoch end' if when == 'epoch' else 'iteration'}"
        gen = self.generation
        if self.state == "running" and gen is not None:
            if servers == gen.servers:
                self.pending = None
                self.message = "already there"
            elif not self._hand_over(gen, servers, when):
                self.state = "moving"
                self._send_stop(gen, when)
        elif self.state == "moving" and self.retiring is not None:
            self.pending = None  # the move under way goes on; only its `when` can change
            old = self.retiring.generation
            if when == "now":
                self.retiring.when = when
                if old.stop_sent == "epoch":
                    self._send_stop(old, when, self._handoff())
        elif self.state == "moving" and gen is not None and when == "now" and gen.stop_sent == "epoch":
            self._send_stop(gen, when)
        elif self.state == "waiting":
            self.allocation, self.pending = list(servers), None
        self._advance()
        return self.status()

    def stop(self, when: When = "now") -> JobStatus:
        """Stop the job (its trainers checkpoint first); the scheduler then ends."""
        if self.state in TERMINAL:
            return self.status()
        self.stopping = when
        gen = self.generation
        if gen is None or gen.all_exited:
            self.state = "stopped"
            self._finish()
        elif self.retiring is not None and self.retiring.generation.stop_sent is None:
            # A move in place still waiting for its joiners: the old generation stops for good instead.
            self.state = "stopping"
            joiners = set(range(gen.plan.world_size)) - set(self.retiring.survivors.values())
            self._send_stop(gen, "kill", only=joiners)
            self._send_stop(self.retiring.generation, when)
        else:
            self.state = "stopping"
            self._send_stop(gen, when)
            if self.retiring is not None:  # rank 0 is handing over: its control file is the one it reads next
                self._send_stop(self.retiring.generation, when)
        self.message = "stop requested"
        return self.status()

    # -- what happens ------------------------------------------------------------------------------

    def _on_event(self, gen: Generation, event: dict[str, Any]) -> None:
        kind = event.get("event")
        record = self.moves[-1] if self.moves and self.moves[-1].generation == gen.number else None
        self.progress.record(event, gen.servers, record)
        if kind == "epoch":
            self._consult_planner()
        elif kind == "peer_lost":
            self.failures.reported(gen, event)
        elif kind == "checkpoint":
            self.checkpoint = checkpoint_folder(self.loaded)
        elif kind == "done":
            gen.done = event
            if self.retiring is not None and gen is self.retiring.generation and not event.get("stopped"):
                self.retiring.finished = True  # the last epoch ended before the move could happen
                if self.generation is not None:
                    self._send_stop(self.generation, "kill")  # the joiners wait for ranks that will not come
            self.checkpoint = checkpoint_folder(self.loaded)  # written on every exit
        elif kind == "ready" and self.retiring is not None and gen is self.generation:
            self.retiring.joiners.discard(event_int(event, "rank") or 0)
            if not self.retiring.joiners and self.retiring.generation.stop_sent is None:
                self._send_stop(self.retiring.generation, self.retiring.when, self._handoff())
        elif kind == "stopping":
            gen.last_iteration = (event_int(event, "step"), event_float(event, "time"))
            if self.retiring is not None and gen is self.retiring.generation and self.moves:
                self.moves[-1].stopped_step, self.moves[-1].last_iteration_at = gen.last_iteration
                self.moves[-1].loss_before = self.progress.loss
        elif kind == "first_step" and record is not None:
            if self.retiring is not None and gen is self.generation:
                self.retiring = None  # handed over: the old generation's leavers exit on their own
                self.state = "running" if self.state == "moving" else self.state
            self.failures.first_step(record)

    def _consult_planner(self) -> None:
        # Also while a move in place waits for its new ranks to start: the decision is logged (a move
        # elsewhere is refused until the one under way is done).
        steady = self.state == "running" or (self.state == "moving" and self.retiring is not None)
        if self.planner is None or not steady or self.progress.epoch >= self.loaded.config.job.epochs:
            return
        try:
            decision = self.planner(self.status())
        except JabasError as exc:  # a planner that cannot plan leaves the job where it is
            self.message = f"the planner failed: {exc}"
            return
        if decision is not None and decision[0] != self.allocation:
            try:
                self.move(*decision)
            except (InputError, Conflict) as exc:
                self.message = f"the planner's move was refused: {exc}"

    def _fail(self, why: str, tail: list[str], lost: tuple[int, set[int]] | None = None) -> None:
        """A failure; ``lost``: the generation and ranks it lost, which a recovery in place may go on without."""
        if self.state in TERMINAL or (lost is not None and self.failures.take(why, *lost)):
            return
        self._fail_now(why, tail)

    def _fail_now(self, why: str, tail: list[str]) -> None:
        """Stop every trainer; the job restarts from its checkpoint (or fails, after ``max_restarts``)."""
        if self.state in TERMINAL:
            return
        detail = f": {tail[-1]}" if tail else ""
        self.message = why + detail
        if self.state == "restarting":
            return  # already going down
        gen = self.generation
        if gen is not None:
            self._send_stop(gen, "kill")  # the others would wait for the lost rank in their next collective
        if self.retiring is not None:
            self._send_stop(self.retiring.generation, "kill")
        if self.state != "stopping":
            self.state = "restarting"

    def _advance(self) -> None:
        """Take every step the current state allows."""
        gen = self.generation
        if self.state == "waiting":
            if self._ready(self.allocation):
                self._launch(self.allocation, reason=None)
        elif self.state == "running" and gen is not None and gen.all_exited:
            if gen.done is not None and not gen.done.get("stopped") and all(c == 0 for c in gen.exits.values()):
                self._succeed()
            else:
                self._fail("the trainers exited before the job was done", [])
                self._advance()
        elif self.state == "moving" and self.retiring is not None:
            if self.retiring.finished and gen is not None and gen.all_exited and self.retiring.leavers_exited:
                self.retiring = None
                self._succeed()
        elif self.state == "moving" and gen is not None and gen.all_exited:
            if gen.done is not None and not gen.done.get("stopped"):
                self._succeed()  # the last epoch ended before the move could happen
            elif self.pending is not None and self._ready(self.pending):
                self._launch(self.pending, reason="move")
        elif self.state == "restarting" and gen is not None and gen.all_exited:
            if self.retiring is not None:
                if not self.retiring.leavers_exited:
                    return
                self.retiring = None
            if self.restarts >= self.max_restarts:
                self.state = "failed"
                self.message = f"gave up after {self.restarts} restarts: {self.message}"
                self._finish()
                return
            wanted = self.pending or gen.servers
            live = [s for s in wanted if self._alive(s)] or [s for s in self.servers if self._alive(s)]
            if live:
                self.restarts += 1
                self._launch(live, reason="restart")
        elif self.state == "stopping" and (gen is None or gen.all_exited):
            if self.retiring is not None:
                if not self.retiring.leavers_exited:
                    return
                self.retiring = None
            self.state = "stopped"
            self.message = f"stopped at step {self.progress.step}; checkpoint {self.checkpoint}"
            self._finish()

    def _ready(self, servers: list[str]) -> bool:
        return all(self._alive(s) for s in servers)

    def _alive(self, server: str) -> bool:
        return any(w.alive and w.server == server for w in self.workers.values())

    def _worker_of(self, server: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.alive and w.server == server), None)

    def _launch(self, servers: list[str], reason: str | None) -> None:
        previous = self.generation
        if previous is None and self.loaded.config.job.plan is not None and servers == self.allocation:
            plan, source = load_plan(self.loaded), "the [job] plan file"
        elif previous is None and self.first is not None and servers == self.first.plan.servers():
            plan = plan_from_solver(self.first.plan, "solver", self.loaded)
            source = f"solved for GBS {plan.gbs} ({self.first.source}), as jabas run plans"
        else:
            plan, source = plan_for(self.loaded, servers, self.progress.gbs if previous is not None else None)
        first = self.loaded.config.server(servers[0])
        gen = self._new_generation(servers, plan, (self.master_addr or first.host, free_port()))
        resume = self.checkpoint is not None and bool(checkpoint_store(self.loaded).entries())
        for server, ranks in gen.ranks_on.items():
            self._send_start(gen, server, ranks, resume)
        if reason == "move" and previous is not None:
            step, at = previous.last_iteration
            self._moved(previous, gen, self.pending_when, "move", stopped_step=step, last_iteration_at=at)
        elif reason == "restart" and previous is not None:
            fields = self.failures.restart_fields()
            self._moved(previous, gen, self.pending_when, "restart", stopped_step=self.progress.step, **fields)
        self.generation, self.allocation, self.pending = gen, list(servers), None
        self.state = "running"
        self.progress.gbs = plan.gbs
        self.message = f"generation {gen.number} on {', '.join(servers)}: {plan.describe()}, {source}"

    def _new_generation(self, servers: list[str], plan: TrainingPlan, master: tuple[str, int]) -> Generation:
        self.generations += 1
        return Generation.start(self.generations, servers, plan, master)

    def _send_start(self, gen: Generation, server: str, ranks: list[int], resume: bool) -> None:
        worker = self._worker_of(server)
        assert worker is not None  # the servers of a generation are all alive when it starts
        worker.commands.append(gen.start_command(ranks, resume, self.loaded.config.scheduler.checkpoint_every))

    def _send_stop(
        self, gen: Generation, when: str, handoff: Handoff | None = None, only: set[int] | None = None
    ) -> None:
        """Send ``stop`` to the agents of ``gen``'s ranks (of the ranks in ``only``, if given)."""
        gen.stop_sent = when
        for server, ranks in gen.ranks_on.items():
            if only is not None and not only & set(ranks):
                continue
            worker = self._worker_of(server)
            if worker is not None:
                worker.commands.append(StopCommand(generation=gen.number, when=when, handoff=handoff))  # type: ignore[arg-type]

    def _hand_over(self, gen: Generation, servers: list[str], when: When) -> bool:
        """Move in place if the new allocation keeps rank 0's server; False: move by restarting instead.

        The next generation starts now: its joiners (the new ranks no trainer carries into it)
        start at once and wait in its rendezvous, and the stop request tells the trainers that
        stay where they go (:mod:`jabascli.engine.handoff`).
        """
        if not self.loaded.config.scheduler.in_place_moves or not self._ready(servers):
            return False  # (a server not registered yet: the move waits for it, as a restart does)
        plan, source = plan_for(self.loaded, servers, self.progress.gbs)
        kept = survivors(gen.plan, plan)
        if kept is None:
            return False
        nxt = self._new_generation(servers, plan, gen.master)
        self.retiring = Retiring(gen, kept, when=when)
        for server, ranks in nxt.ranks_on.items():
            joiners = [r for r in ranks if r not in kept.values()]
            if joiners:  # they resume from the checkpoint the stopping generation writes before it opens
                self._send_start(nxt, server, joiners, resume=True)
                self.retiring.joiners.update(joiners)
        if not self.retiring.joiners:
            self._send_stop(gen, when, handoff(self.retiring, nxt))
        self._moved(gen, nxt, when, "move", in_place=True)
        self.generation, self.allocation, self.pending = nxt, list(servers), None
        self.state = "moving"
        self.message = (
            f"moving in place to {', '.join(servers)} at the next {'epoch end' if when == 'epoch' else 'iteration'}:"
            f" {plan.describe()}, {source}"
        )
        return True

    def _moved(self, previous: Generation, nxt: Generation, when: When, reason: MoveReason, **fields: Any) -> None:
        """Record the move from ``previous`` to ``nxt``, launched now (``fields``: the record's others)."""
        self.moves.append(
            MoveRecord(
                generation=nxt.number,
                from_servers=previous.servers,
                to_servers=list(nxt.servers),
                when=when,
                reason=reason,
                launched_at=time.time(),
                loss_before=self.progress.loss,
                **fields,
            )
        )

    def _handoff(self) -> Handoff:
        assert self.retiring is not None and self.generation is not None
        return handoff(self.retiring, self.generation)

    def _succeed(self) -> None:
        self.state = "succeeded"
        self.message = f"finished {self.progress.epoch} epochs at step {self.progress.step}"
        self._finish()

    def _finish(self) -> None:
        self.finished_at = self.clock()

    # -- reporting ---------------------------------------------------------------------------------

    def status(self) -> JobStatus:
        now = self.clock()
        gen = self.generation
        cfg = self.loaded.config
        return JobStatus(
            job=cfg.job.name,
            state=self.state,
            allocation=list(self.allocation),
            generation=gen.number if gen else 0,
            plan=gen.plan.describe() if gen else None,
            epochs=cfg.job.epochs,
            restarts=self.restarts,
            max_restarts=self.max_restarts,
            checkpoint=str(self.checkpoint) if self.checkpoint else None,
            message=self.message,
            trainers=sorted(gen.running.values(), key=lambda t: t.rank) if gen else [],
            workers=[w.status(now) for w in sorted(self.workers.values(), key=lambda w: w.rank)],
            moves=[m.model_copy() for m in self.moves],
            scaling=getattr(self.planner, "last", None),
            **self.progress.status_fields(),
        )
