"""A job's generations as the scheduler tracks them (:mod:`jabascli.elastic.job`): the workers, each generation's
ranks and exits, and the one a move in place or a recovery hands over from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jabascli.elastic.protocol import Command, Handoff, RunningTrainer, StartCommand, When, WorkerStatus
from jabascli.engine.plan import TrainingPlan


@dataclass
class Worker:
    rank: int
    server: str
    host: str
    last_seen: float
    alive: bool = True
    commands: list[Command] = field(default_factory=list)

    def status(self, now: float) -> WorkerStatus:
        return WorkerStatus(
            rank=self.rank, server=self.server, host=self.host, alive=self.alive, seen_s_ago=now - self.last_seen
        )


@dataclass
class Generation:
    number: int
    servers: list[str]
    plan: TrainingPlan
    ranks_on: dict[str, list[int]]
    """Server name -> the global ranks it runs."""
    exits: dict[int, int] = field(default_factory=dict)
    """Rank -> exit code (None never: a lost worker's ranks count as killed, -9)."""
    done: dict[str, Any] | None = None
    """Rank 0's ``done`` event."""
    stop_sent: str | None = None
    running: dict[int, RunningTrainer] = field(default_factory=dict)
    last_iteration: tuple[int | None, float | None] = (None, None)
    """Rank 0's ``stopping`` event: the step and wall time of its last iteration."""
    master: tuple[str, int] = ("", 0)
    """Where its trainers meet (the TCP store rank 0 hosts)."""

    @classmethod
    def start(cls, number: int, servers: list[str], plan: TrainingPlan, master: tuple[str, int]) -> Generation:
        """Generation ``number`` of ``plan`` on ``servers``, meeting at ``master``."""
        ranks_on: dict[str, list[int]] = {}
        for r in plan.ranks:
            ranks_on.setdefault(r.server, []).append(r.rank)
        return cls(number, list(servers), plan, ranks_on, master=master)

    def start_command(self, ranks: list[int], resume: bool, checkpoint_every: int | None) -> StartCommand:
        """What starts ``ranks`` of it (``resume``: from the job's checkpoint)."""
        return StartCommand(
            generation=self.number,
            ranks=ranks,
            world_size=self.plan.world_size,
            master_addr=self.master[0],
            master_port=self.master[1],
            plan=self.plan.to_dict(),
            resume=resume,
            checkpoint_every=checkpoint_every,
        )

    @property
    def all_exited(self) -> bool:
        return len(self.exits) == self.plan.world_size


@dataclass
class Retiring:
    """The generation a move in place is handing over from, until the next one's first iteration."""

    generation: Generation
    survivors: dict[int, int]
    """Old rank -> its rank in the next generation."""
    finished: bool = False
    """It finished the job before the move happened: the next generation's joiners are stopped."""
    when: When = "epoch"
    joiners: set[int] = field(default_factory=set)
    """The next generation's ranks started for the move that have not said they are ``ready`` yet:
    the stop is sent once there are none, so that the job trains on while they start."""

    @property
    def leavers_exited(self) -> bool:
        leavers = set(range(self.generation.plan.world_size)) - set(self.survivors)
        return leavers <= set(self.generation.exits)


def record_exit(gen: Generation | None, retiring: Retiring | None, generation: int, rank: int, code: int) -> bool:
    """Count a trainer's exit in the current generation ``gen`` or the ``retiring`` one; False if it was
    counted before or belongs to neither.

    A survivor of a move in place that exits under its old generation (before it handed over)
    is also its new rank's exit.
    """
    if gen is not None and generation == gen.number:
        if rank in gen.exits:
            return False
        gen.exits[rank] = code
        gen.running.pop(rank, None)
        return True
    if retiring is not None and generation == retiring.generation.number:
        if rank in retiring.generation.exits:
            return False
        retiring.generation.exits[rank] = code
        if rank in retiring.survivors and gen is not None:
            gen.exits.setdefault(retiring.survivors[rank], code)
        return True
    return False


def handoff(retiring: Retiring, nxt: Generation) -> Handoff:
    """What the trainers that stay are told of ``nxt``, the generation ``retiring`` hands over to."""
    ranks = {str(old): new for old, new in retiring.survivors.items()}
    return Handoff(generation=nxt.number, world_size=nxt.plan.world_size, plan=nxt.plan.to_dict(), ranks=ranks)
