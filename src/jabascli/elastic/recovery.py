"""The scheduler's side of a failure: recovery in place when the survivors can go on, a restart otherwise.

A failure of the running generation is seen as a trainer's exit with an error, a
node whose agent misses heartbeats, or a survivor's ``peer_lost`` event (its
collective raised: the peer is gone, or did not answer within ``[scheduler]
collective_timeout_s``; engine/recovery.py). The lost ranks are those that exited,
those of lost nodes, and, when only survivors spoke (a hung rank: alive, silent),
those that did not say their collective failed within :data:`GRACE_S` of the first
that did. Every server with a lost rank leaves the allocation.

If rank 0 is among the survivors (it hosts the job's store) and the job has no
``[parallel]`` layout (whose shards no survivor holds whole), the scheduler starts
the next generation *in place*: the plan for the servers left (:func:`plan_for`, at
the job's GBS where the profiles allow), the survivors' old -> new ranks, sent as a
``recover`` stop with the handoff to rank 0's agent, which writes it into rank 0's
control file; the trainers still running on the servers that leave are stopped.
The survivors carry on from their memory, no checkpoint read, no step lost.
Otherwise the job restarts from its checkpoint, as before, and the restart's record
says why (``failure``). Either way the record in ``moves[]`` has when the failure
was seen, the time from then to the end of the first iteration after
(``recovered_s``) and the completed steps done again (``steps_lost``).

Servers left out by a recovery are taken back with a move at the next epoch end
once their agents are registered (at once, if they are: a trainer died, its node
did not; or when a lost node registers again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jabascli.config import LoadedConfig
from jabascli.elastic.generations import Generation, Retiring, Worker, handoff, record_exit
from jabascli.elastic.plans import plan_for, survivors
from jabascli.elastic.progress import Progress
from jabascli.elastic.protocol import JobState, MoveReason, MoveRecord, StopCommand, When
from jabascli.engine.plan import TrainingPlan
from jabascli.errors import InputError

GRACE_S = 1.0
"""From the first sign of a failure, how long the other ranks have to report (or to exit, or their nodes to be
found lost) before the scheduler decides without them."""


class Scheduler(Protocol):
    """What recovery reads and changes of the scheduler (:class:`jabascli.elastic.job.Scheduler`)."""

    loaded: LoadedConfig
    clock: Callable[[], float]
    state: JobState
    generation: Generation | None
    retiring: Retiring | None
    allocation: list[str]
    pending: list[str] | None
    stopping: When | None
    moves: list[MoveRecord]
    progress: Progress
    message: str
    workers: dict[int, Worker]

    def _alive(self, server: str) -> bool: ...
    def _worker_of(self, server: str) -> Worker | None: ...
    def _new_generation(self, servers: list[str], plan: TrainingPlan, master: tuple[str, int]) -> Generation: ...
    def _fail(self, why: str, tail: list[str], lost: tuple[int, set[int]] | None = None) -> None: ...
    def _fail_now(self, why: str, tail: list[str]) -> None: ...
    def _moved(self, previous: Generation, nxt: Generation, when: When, reason: MoveReason, **fields: Any) -> None: ...
    def move(self, servers: list[str], when: When = "epoch") -> Any: ...


@dataclass
class Failure:
    generation: int
    seen: float
    """The scheduler's clock when it was first seen."""
    at: float
    """Wall time it was first seen (a survivor's report carries its own)."""
    why: str
    """Its cause: a lost rank's exit once one is known, else the first survivor's report."""
    step: int
    """The last completed step reported before it."""
    lost: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)
    """Ranks that said their collective failed and wait for the recovery order."""
    dirty: set[int] = field(default_factory=set)
    """Ranks that said their failed iteration had applied part of an update (they exit)."""
    taken_back: int = 0
    """The most bucket updates a survivor put back (``overlap``)."""


class Failures:
    """Decides what a failure of the running generation becomes; called under the scheduler's lock."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.pending: Failure | None = None
        self.recovering: int | None = None
        """The generation a recovery in place is handing over from, until the next one's first iteration."""
        self.wanted: list[str] | None = None
        """The allocation before a recovery: its servers are taken back when they can be."""
        self.restart: dict[str, Any] = {}
        """The failure a restart follows, for its record (``failure``, ``failed_at``)."""

    # -- what is seen ----------------------------------------------------------------------------------

    def take(self, why: str, generation: int, lost: set[int]) -> bool:
        """Ranks ``lost`` of ``generation`` (exited, or on a lost node): True when handled here, False when
        the scheduler restarts the job as it always did."""
        s, gen = self.s, self.s.generation
        if self.recovering == generation and s.retiring is not None and not lost & set(s.retiring.survivors):
            return True  # a rank the recovery left behind ends (the lost one, or one stopped)
        if s.retiring is not None and s.retiring.finished and gen is not None and gen.number == generation:
            return True  # the job ended before a move: its new ranks, waiting for it, were stopped
        if not self._may_recover(generation):
            self.restart = self.restart or {"failure": why, "failed_at": time.time()}  # the first one, for the record
            return False
        failure = self._failure(why)
        if failure.lost <= failure.dirty:  # only survivors spoke before it: a lost rank is the cause
            failure.why = why
        failure.lost |= lost
        self.decide()
        return True

    def reported(self, gen: Generation, event: dict[str, Any]) -> None:
        """A survivor's ``peer_lost`` event: its collective raised, and it waits for the order."""
        rank, step, when, moves = event.get("rank"), event.get("step"), event.get("time"), self.s.moves
        taken_back = event.get("taken_back")
        if self.recovering == gen.number and moves:  # decided before this survivor spoke: its figures are better
            record = moves[-1]
            if isinstance(taken_back, int) and taken_back > 0:
                record.updates_taken_back = max(record.updates_taken_back or 0, taken_back)
            if isinstance(step, int) and record.stopped_step is not None:
                record.stopped_step = max(record.stopped_step, step)
            if isinstance(when, int | float) and record.failed_at is not None:
                record.failed_at = min(record.failed_at, float(when))
        if isinstance(step, int) and gen is self.s.generation:
            self.s.progress.step = max(self.s.progress.step, step)  # completed steps, exactly: the reports lag behind
        if isinstance(when, int | float) and self.restart:
            self.restart["failed_at"] = min(self.restart["failed_at"], float(when))
        if not isinstance(rank, int) or not self._may_recover(gen.number):
            return
        message = event.get("message")
        failure = self._failure(f"rank {rank}'s collective failed ({message})")
        if event.get("in_place") is False:  # it applied part of an update and exits: lost with the others
            failure.lost.add(rank)
            failure.dirty.add(rank)
            self.decide()
            return
        failure.reported.add(rank)
        if isinstance(taken_back, int):
            failure.taken_back = max(failure.taken_back, taken_back)
        if isinstance(step, int):
            failure.step = max(failure.step, step)  # the scheduler's own is the last reported, maybe older
        if isinstance(when, int | float):
            failure.at = min(failure.at, float(when))
        self.decide()

    def _may_recover(self, generation: int) -> bool:
        s, gen = self.s, self.s.generation
        return (
            s.loaded.config.scheduler.recover_in_place
            and s.state == "running"
            and s.retiring is None
            and gen is not None
            and gen.number == generation
            and gen.done is None
        )

    def _failure(self, why: str) -> Failure:
        gen = self.s.generation
        assert gen is not None
        if self.pending is None or self.pending.generation != gen.number:
            self.pending = Failure(gen.number, self.s.clock(), time.time(), why, self.s.progress.step)
        return self.pending

    def silent_workers(self) -> None:
        """Declare lost every worker silent for ``heartbeat_timeout_s``; their ranks count as killed."""
        s = self.s
        timeout = s.loaded.config.scheduler.heartbeat_timeout_s
        now = s.clock()
        silent = [w for w in s.workers.values() if w.alive and now - w.last_seen > timeout]
        for worker in silent:  # all of them first: a recovery decided on the first keeps none of the others
            worker.alive = False
        for worker in silent:
            gen = s.generation
            lost = gen.ranks_on.get(worker.server, []) if gen is not None else []
            if s.retiring is not None:
                for r in s.retiring.generation.ranks_on.get(worker.server, []):
                    record_exit(gen, s.retiring, s.retiring.generation.number, r, -9)
            if gen is not None and any(r not in gen.exits for r in lost):
                for r in lost:
                    gen.exits.setdefault(r, -9)
                why = f"worker {worker.rank} ({worker.server}) missed heartbeats for {timeout:g} s"
                s._fail(why, [], (gen.number, set(lost)))

    # -- the decision ----------------------------------------------------------------------------------

    def decide(self) -> None:
        """Decide a pending failure once every rank is accounted for (lost, or reported), or :data:`GRACE_S`
        after its first sign: the silent ranks are lost when none is known lost (a hang), survivors otherwise."""
        s, failure = self.s, self.pending
        if failure is None:
            return
        gen = s.generation
        if gen is None or not self._may_recover(failure.generation):
            self.pending = None
            return
        world = set(range(gen.plan.world_size))
        lost = set(failure.lost)
        if lost | failure.reported != world and s.clock() - failure.seen < GRACE_S:
            return  # the others may still report, or other nodes be found lost (a failure seldom comes alone)
        if not lost:
            lost = world - failure.reported  # alive and silent: hung, frozen or cut off
        self.pending = None
        dropped = {server for server, ranks in gen.ranks_on.items() if lost & set(ranks) or not s._alive(server)}
        keep = [server for server in gen.servers if server not in dropped]
        why_not = self._why_not(gen, lost, keep)
        if why_not is not None and 0 in failure.dirty:
            why_not = "rank 0 had applied part of the failed iteration's update (overlap weight sync)"
        if why_not is None:
            why_not = self._recover(gen, failure, keep, dropped)
        if why_not is not None:
            self.restart = {"failure": f"{failure.why}; {why_not}", "failed_at": failure.at}
            s._fail_now(f"{failure.why}: restarting from the checkpoint ({why_not})", [])

    def _why_not(self, gen: Generation, lost: set[int], keep: list[str]) -> str | None:
        """Why the job cannot go on in place; the layout's reason first, as it holds whichever rank was lost
        (under load a survivor's own exit may count it lost too before the scheduler decides)."""
        if _sharded(gen.plan.parallel or self.s.loaded.config.parallel):
            return "a [parallel] layout: no survivor holds every shard"
        if not lost:
            return "no rank was lost, yet a collective failed"
        if 0 in lost or gen.servers[0] not in keep:
            return "rank 0 was lost, and with it the job's store"
        return None

    def _recover(self, gen: Generation, failure: Failure, keep: list[str], dropped: set[str]) -> str | None:
        """Start the next generation on ``keep`` in place; the reason when it cannot be done."""
        s = self.s
        try:
            plan, source = plan_for(s.loaded, keep, s.progress.gbs)
        except InputError as exc:
            return f"no plan for {', '.join(keep)}: {exc.lines()[0] if exc.lines() else exc}"
        if _sharded(plan.parallel):  # its trainers would restore their shards from the checkpoint
            return f"the plan for {', '.join(keep)} has a [parallel] layout"
        kept = survivors(gen.plan, plan)
        if kept is None or set(range(plan.world_size)) - set(kept.values()):
            return f"the plan for {', '.join(keep)} needs ranks that no survivor fills"
        for server in dropped:  # its trainers still running (hung, or a survivor of a lost one) are stopped
            worker = s._worker_of(server)
            if worker is not None:
                worker.commands.append(StopCommand(generation=gen.number, when="kill"))
        nxt = s._new_generation(keep, plan, gen.master)
        s.retiring = Retiring(gen, kept, when="now")
        rank0 = s._worker_of(gen.servers[0])
        assert rank0 is not None  # kept, so alive
        rank0.commands.append(StopCommand(generation=gen.number, when="recover", handoff=handoff(s.retiring, nxt)))
        gen.stop_sent = "recover"
        fields = {"failure": failure.why, "failed_at": failure.at, "stopped_step": failure.step}
        if failure.taken_back:
            fields["updates_taken_back"] = failure.taken_back
        s._moved(gen, nxt, "now", "recovery", in_place=True, **fields)
        self.recovering = gen.number
        self.wanted = self.wanted or list(gen.servers)
        s.generation, s.allocation, s.pending = nxt, list(keep), None
        s.state = "moving"
        s.message = f"{failure.why}: recovering in place on {', '.join(keep)}: {plan.describe()}, {source}"
        return None

    # -- after -----------------------------------------------------------------------------------------

    def first_step(self, record: MoveRecord | None) -> None:
        """The next generation's first iteration: the record's recovery figures; servers left out come back."""
        if record is not None and record.failed_at is not None:
            if record.first_iteration_at is not None and record.first_iteration_s is not None:
                record.recovered_s = record.first_iteration_at + record.first_iteration_s - record.failed_at
            if record.downtime_s is None and record.first_iteration_at is not None:
                record.downtime_s = record.first_iteration_at - record.failed_at  # no iteration ran since
            if record.stopped_step is not None and record.resumed_step is not None:
                record.steps_lost = max(0, record.stopped_step - record.resumed_step)
        self.recovering = None
        self.take_back()

    def restart_fields(self) -> dict[str, Any]:
        """The failure a restart follows, for its record (once)."""
        fields, self.restart = self.restart, {}
        return fields

    def take_back(self) -> None:
        """Move at the next epoch end onto the servers a recovery left out that are registered again."""
        s = self.s
        if self.wanted is None or s.state != "running" or s.retiring is not None or s.stopping is not None:
            return
        back = [server for server in self.wanted if server in s.allocation or s._alive(server)]
        if set(back) <= set(s.allocation):
            return
        if back == self.wanted:
            self.wanted = None
        s.move(back, "epoch")


def _sharded(layout: Any) -> bool:
    """Whether a ``[parallel]`` layout splits a replica over ranks (shards, TP slices, stages, per-block rules)."""
    return layout is not None and ((layout.tp, layout.pp, layout.sharding) != (1, 1, "none") or bool(layout.layers))
