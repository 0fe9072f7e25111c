"""A job's generations as the scheduler tracks them (:mod:`jabascli.elastic.job`): the workers, each generation's
ranks and exits, and the one a move in place or a recovery hands over from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jabascli.elastic.protocol import Command, RunningTrainer, When
from jabascli.engine.plan import TrainingPlan


@dataclass
class Worker:
    rank: int
    server: str
    host: str
    last_seen: float
    alive: bool = True
    commands: list[Command] = field(default_factory=list)


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
