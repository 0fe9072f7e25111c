"""The messages between ``jabas schedule``, its ``jabas worker`` agents and ``jabas job``: JSON over HTTP.

Workers pull: a worker registers once, then every heartbeat carries what
happened on its node (trainer events and exits) and its reply carries the
commands for the node (start these ranks, stop them). So only the scheduler
listens on the network, and nothing received is ever executed as code: a
command is a fixed set of typed fields that the worker turns into an argument
list for ``jabas train``.

===========================  ==========================================================
``GET  /healthz``            open; ``{"ok": true}``
``POST /v1/workers``         :class:`Registration` -> :class:`Registered` (409: rank taken)
``POST /v1/workers/{rank}/heartbeat``  :class:`Heartbeat` -> :class:`Commands`
``GET  /v1/job``             :class:`JobStatus`
``POST /v1/job/move``        :class:`MoveRequest` -> :class:`JobStatus` (422: unknown server)
``POST /v1/job/stop``        :class:`StopRequest` -> :class:`JobStatus`
``GET  /openapi.json``       the schema
===========================  ==========================================================

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``. No
message carries a non-finite number (JSON has none: ``1e999999`` parses to
infinity in Python): one is refused with 422, and agents send a trainer's NaN
loss as null (:func:`finite_only`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator

When = Literal["epoch", "now"]
"""When a job moves or stops: at the next epoch end, or at the next iteration boundary."""
JobState = Literal["waiting", "running", "moving", "restarting", "stopping", "succeeded", "failed", "stopped"]

Name = Annotated[str, Field(min_length=1, max_length=200)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def finite_only(value: Any) -> Any:
    """``value`` with every non-finite float (inf, NaN) replaced by None, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_only(v) for v in value]
    return value


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_non_finite(v) for v in value)
    return False


class DeviceInfo(Message):
    """What :func:`jabascli.devices.detect_devices` found on a node."""

    backend: Literal["cuda", "cpu"]
    device_type: Name
    count: NonNegativeInt
    memory_bytes: NonNegativeInt


class Registration(Message):
    rank: NonNegativeInt = Field(le=10_000)
    """The worker's rank: the index of its server in ``[[cluster.servers]]``."""
    host: Name
    devices: DeviceInfo
    pid: NonNegativeInt = 0


class Registered(Message):
    server: str
    """The name of the server this worker stands for."""
    heartbeat_interval_s: float


class TrainerExit(Message):
    generation: NonNegativeInt
    rank: NonNegativeInt
    code: int
    """The exit status; negative: killed by that signal."""
    log_tail: str = Field("", max_length=20_000)


class TrainerEvent(Message):
    """One progress event of a trainer (see :mod:`jabascli.engine.events`)."""

    generation: NonNegativeInt
    event: dict[str, Any]

    @field_validator("event")
    @classmethod
    def _finite(cls, event: dict[str, Any]) -> dict[str, Any]:
        if _has_non_finite(event):
            raise ValueError("a non-finite number (send null instead)")
        return event


MAX_HEARTBEAT_WAIT_S = 2.0
"""The longest a heartbeat may ask to be held (:attr:`Heartbeat.wait_s`); the scheduler holds it at most half
its ``heartbeat_timeout_s`` too."""


class RunningTrainer(Message):
    generation: NonNegativeInt
    rank: NonNegativeInt
    pid: NonNegativeInt


class Heartbeat(Message):
    running: list[RunningTrainer] = Field(default_factory=list, max_length=10_000)
    """The trainers still running on this node."""
    events: list[TrainerEvent] = Field(default_factory=list, max_length=10_000)
    exits: list[TrainerExit] = Field(default_factory=list, max_length=10_000)
    wait_s: float = Field(0.0, ge=0.0, le=MAX_HEARTBEAT_WAIT_S)
    """How long the scheduler may hold the reply until a command for this node is due (every trainer here
    waits for its recovery order: the reply goes out the moment the order is decided, not a beat later)."""


class StartCommand(Message):
    """Start these ranks of a new generation of trainers."""

    kind: Literal["start"] = "start"
    generation: NonNegativeInt
    ranks: list[NonNegativeInt]
    world_size: PositiveInt
    master_addr: Name
    master_port: int = Field(ge=1, le=65535)
    plan: dict[str, Any]
    """The plan in the plan-file form (``jabas solve --out``); the trainer checks it."""
    resume: bool
    """Resume from the job's checkpoint (``[storage] checkpoint_dir``)."""
    checkpoint_every: PositiveInt | None = None


class Handoff(Message):
    """A move in place (:mod:`jabascli.engine.handoff`): the generation the stopping one hands over to."""

    generation: NonNegativeInt
    world_size: PositiveInt
    plan: dict[str, Any]
    ranks: dict[str, NonNegativeInt]
    """Old rank (as a string: a JSON key) -> new rank, for the ranks that stay."""


class StopCommand(Message):
    """Stop a generation: ``epoch``/``now`` through the trainers' stop hook (they checkpoint), ``kill``
    by signal. With ``handoff``, the trainers that stay carry on into the next generation."""

    kind: Literal["stop"] = "stop"
    generation: NonNegativeInt
    when: Literal["epoch", "now", "kill", "recover"]
    """``recover``: the generation lost a rank; ``handoff`` says where its survivors go (engine/recovery.py)."""
    handoff: Handoff | None = None


Command = Annotated[StartCommand | StopCommand, Field(discriminator="kind")]


class Commands(Message):
    commands: list[Command] = Field(default_factory=list)
    shutdown: bool = False
    """The job is over: the worker exits."""


class MoveRequest(Message):
    servers: list[Name] = Field(min_length=1, max_length=10_000)
    """The new allocation: names of ``[[cluster.servers]]``."""
    when: When = "epoch"


class StopRequest(Message):
    when: When = "now"


class WorkerStatus(Message):
    rank: int
    server: str
    host: str
    alive: bool
    seen_s_ago: float


MoveReason = Literal["move", "restart", "recovery"]


class MoveRecord(Message):
    generation: int
    """The generation started by the move."""
    from_servers: list[str]
    to_servers: list[str]
    when: When
    reason: MoveReason
    """``recovery``: a failure recovered in place; ``restart``: one recovered from the checkpoint."""
    in_place: bool = False
    """The trainers that stayed carried on (a move in place); False: every trainer was restarted."""
    failure: str | None = None
    """What failed (a failure's recovery or restart), and for a restart why it was not recovered in place."""
    failed_at: float | None = None
    """When the failure was first seen: a survivor's collective raised, a trainer's exit or a lost node reported."""
    recovered_s: float | None = None
    """From ``failed_at`` to the end of the first iteration after."""
    steps_lost: int | None = None
    """Completed steps done again after a failure: 0 in place, back to the checkpoint's step on a restart."""
    updates_taken_back: int | None = None
    """Bucket updates of the interrupted iteration that a survivor had applied and put back (``overlap`` weight
    sync, recovery in place: engine/bucket_undo.py); the most any survivor reported."""
    stopped_step: int | None = None
    """The last step before: where the trainers stopped (a move), or the last one reported (a failure)."""
    resumed_step: int | None = None
    """The step the new generation resumed at: its checkpoint's."""
    loss_before: float | None = None
    loss_after: float | None = None
    """The training loss last reported before, and first reported after."""
    last_iteration_at: float | None = None
    """When the last iteration before ended (wall clock, as the two below)."""
    launched_at: float | None = None
    """When the scheduler sent the new generation's start commands (for a move in place: the stop request
    that carries it, which comes before the last iteration)."""
    first_iteration_at: float | None = None
    """When the first iteration after began."""
    first_iteration_s: float | None = None
    """How long that first iteration took (with its one-off set-up: compare with a later one)."""
    downtime_s: float | None = None
    """The time no iteration ran: from the end of the last iteration before to the start of the first after."""


class EpochRecord(Message):
    """One epoch end: what a planner needs (the GBS history)."""

    epoch: int
    step: int
    gbs: int | None
    servers: list[str]
    train_loss: float | None
    val_loss: float | None
    samples_per_s: float
    time_s: float
    val_accuracy: float | None = None
    gbs_history: list[int] = Field(default_factory=list)
    """The GBS after each adjustment point of this epoch (adaptive jobs; empty for a fixed GBS)."""


class JobStatus(Message):
    job: str
    state: JobState
    allocation: list[str]
    generation: int
    plan: str | None
    gbs: int | None
    epoch: int
    epochs: int
    step: int
    loss: float | None
    restarts: int
    max_restarts: int
    checkpoint: str | None
    checkpoint_step: int | None = None
    initial_loss: float | None = None
    """The first training loss reported: how far a move must not fall back."""
    message: str = ""
    trainers: list[RunningTrainer] = Field(default_factory=list)
    workers: list[WorkerStatus] = Field(default_factory=list)
    moves: list[MoveRecord] = Field(default_factory=list)
    epoch_history: list[EpochRecord] = Field(default_factory=list)
    scaling: dict[str, Any] | None = None
    """The auto-scaling planner's latest decision (a ``scaling.jsonl`` record), with ``[scaling] enabled``."""
