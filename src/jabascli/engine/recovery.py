"""Recovery in place: when a peer is lost, the trainers left carry on from their memory, not a checkpoint.

A collective raises when a peer is gone (gloo: its connection closed) or does not
answer within ``[scheduler] collective_timeout_s`` (hung, frozen, unreachable).
Under an elastic controller (``JABAS_GENERATION`` set) a plain IIDP trainer then:

1. abandons the iteration under way, which changed nothing: the optimizer
   applied no update from it (with ``overlap`` weight sync no bucket was updated
   either: a bucket updates only once its own all-reduce succeeded,
   :mod:`jabascli.engine.weight_sync`), and the running statistics its forwards
   wrote go back to where the iteration began
   (:meth:`~jabascli.engine.buffers.BufferSync.abandon`). Its parameters,
   optimizer and LR scheduler state, progress (step, sampler position) and GBS
   history are those after the last completed iteration, so the next one redoes
   the failed iteration's samples (the RNG is not rewound: its draws in the
   failed iteration stay drawn). With ``overlap`` weight sync, the buckets the
   failed iteration had already updated are first put back from their undo log
   (:mod:`jabascli.engine.bucket_undo`). A failure after an update that has no
   undo log was applied (outside an elastic controller that recovers in place)
   cannot be undone here: the trainer raises, and the job restarts from its
   checkpoint;
2. reports it (``peer_lost`` event: its rank, step, when, and whether it can
   recover), frees its old trainer and builds the next one's model while the
   report travels, and waits for the controller's order, a *recovery handoff*
   (:class:`~jabascli.engine.handoff.Handoff`: the next generation, old -> new
   ranks, the plan for the servers left). Rank 0 reads it from its control file
   (``{"when": "recover", "handoff": {...}}``) and publishes it as JSON under
   ``g<N>/recover`` in the job's TCP store, which every trainer is connected to;
   the others wait on that key. Nothing received is unpickled;
3. joins the next generation's process group through that store
   (:func:`jabascli.engine.distributed.rejoin`), builds its trainer for the new
   plan from its own state in memory (:func:`in_memory_checkpoint`: the live
   tensors, not a file), and checks that every survivor holds the same state
   (:func:`check_agreement`: one all-reduce of a few numbers) before training on.

Rank 0 hosts the store, so a lost rank 0 leaves nothing to rejoin: the controller
restarts from the checkpoint then, as it does for a layout whose shards no
survivor holds (``[parallel]``), and the trainers it stops exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from jabascli.config import LoadedConfig
from jabascli.engine.bucket_undo import UndoLog
from jabascli.engine.checkpoint import CheckpointState, checkpoint_payload
from jabascli.engine.distributed import DistEnv, rendezvous_store
from jabascli.engine.events import EventSink
from jabascli.engine.handoff import MAX_BYTES, Handoff
from jabascli.engine.trainer_env import GENERATION_ENV
from jabascli.errors import JabasError, RuntimeFailure

if TYPE_CHECKING:
    from jabascli.engine.weight_sync import BucketOptimizer

RECOVER = "recover"
"""The ``when`` of a recovery order in rank 0's control file, and the store key it is published under."""
POLL_S = 0.001
"""How often rank 0 looks for its recovery order in its control file."""
STORE_WAIT = timedelta(seconds=1)
"""The other survivors wait on the store's key in waits this long."""


class Recoverable(Protocol):
    """What recovery reads of a trainer (a :class:`~jabascli.engine.trainer.Trainer`)."""

    loaded: Any
    in_flight: int | None
    step_policy: Any
    workers: Any
    buffers: Any
    layout: Any
    progress: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    control: Any

    def checkpoint_state(self) -> CheckpointState: ...


def _bucket_optimizer(trainer: Any) -> BucketOptimizer | None:
    return getattr(getattr(getattr(trainer, "workers", None), "gradients", None), "optimizer", None)


def updates_applied(trainer: Any) -> int:
    """Optimizer updates a trainer applied so far: its steps, and with ``overlap`` its bucket updates."""
    bucket = _bucket_optimizer(trainer)
    return int(trainer.step_policy.applied) + int(bucket.applied if bucket is not None else 0)


def iteration_begins(trainer: Any) -> int:
    """An iteration begins: the updates applied so far (what a failure in it is measured against); the bucket
    updates of the one before are kept for good."""
    bucket = _bucket_optimizer(trainer)
    if bucket is not None and bucket.undo is not None:
        bucket.undo.begin()
    return updates_applied(trainer)


def undo_log(loaded: LoadedConfig, environ: Mapping[str, str] | None = None) -> UndoLog | None:
    """An undo log for ``overlap``'s bucket updates where a failure is recovered in place (under an elastic
    controller, ``[scheduler] recover_in_place``), else None (engine/bucket_undo.py)."""
    env = os.environ if environ is None else environ
    return UndoLog() if GENERATION_ENV in env and loaded.config.scheduler.recover_in_place else None


@dataclass(frozen=True)
class Order:
    """The controller's recovery order, as this rank follows it."""

    handoff: Handoff
    env: DistEnv | None
    """This rank in the next generation; None: it leaves (its server is not in the new allocation)."""


@dataclass(frozen=True)
class Survivor:
    """A trainer that lost a peer and goes on from memory once the controller's order comes."""

    env: DistEnv
    control: Path | None
    """Rank 0's control file, where its order comes."""
    payload: dict[str, Any]
    """Its state after its last completed iteration, in checkpoint form (live tensors)."""

    def wait_for_order(self) -> Order:
        """Wait here until the controller's order comes (or a stop signal)."""
        handoff = _wait_for_order(self.env, self.control)
        return Order(handoff, handoff.env_for(self.env))


def lost_peer(
    trainer: Recoverable | None, env: DistEnv, exc: BaseException, on_event: EventSink | None
) -> Survivor | None:
    """After ``exc`` ended training: this trainer as a survivor, or None when this is no case for recovery
    in place.

    None (the caller re-raises) outside an elastic controller, on one rank, for bad input, under a
    ``[parallel]`` layout, and with ``[scheduler] recover_in_place = false`` (after its report). A trainer
    whose failed iteration already applied an update reports that and raises. Otherwise it has reported,
    and its state is kept: the caller frees the old trainer and builds ahead while the order travels, then
    waits for it (:meth:`Survivor.wait_for_order`).
    """
    if trainer is None or env.generation is None or env.world_size == 1:
        return None
    if isinstance(exc, JabasError) or not isinstance(exc, RuntimeError) or trainer.layout is not None:
        return None
    failed_at = time.time()
    bucket, taken_back = _bucket_optimizer(trainer), 0
    if trainer.in_flight is not None and bucket is not None and bucket.undo is not None:
        # overlap: the buckets already updated in the failed iteration are put back (engine/bucket_undo.py)
        taken_back = bucket.undo.take_back(bucket.optimizer.state)
        bucket.applied = trainer.in_flight - int(trainer.step_policy.applied)  # none of its updates stands
    dirty = trainer.in_flight is not None and updates_applied(trainer) != trainer.in_flight
    if on_event is not None:
        with contextlib.suppress(OSError):
            on_event(
                {
                    "event": "peer_lost",
                    "rank": env.rank,
                    "generation": env.generation,
                    "step": trainer.progress.step,
                    "time": failed_at,
                    "in_place": not dirty,
                    "taken_back": taken_back,
                    "message": f"{type(exc).__name__}: {exc}"[:300],
                }
            )
    if not trainer.loaded.config.scheduler.recover_in_place:
        return None  # the job restarts from its checkpoint: exit as always
    if dirty:
        raise RuntimeFailure.at(
            None, None, f"a collective failed after part of step {trainer.progress.step + 1} was applied: {exc}"
        ) from exc
    if trainer.in_flight is not None:
        trainer.buffers.abandon()
    return Survivor(env, trainer.control.path, in_memory_checkpoint(trainer))


def in_memory_checkpoint(trainer: Recoverable) -> dict[str, Any]:
    """The trainer's state as a checkpoint holds it, without writing one (the live tensors)."""
    return checkpoint_payload(trainer.checkpoint_state())


def check_agreement(trainer: Recoverable, device: torch.device) -> None:
    """Every survivor of a recovery holds the same state (RuntimeFailure otherwise): one all-reduce of
    the progress and of sums over the parameters and the optimizer's state, as their maxima and minima.
    A lone survivor has no one to disagree with."""
    if dist.get_world_size() == 1:
        return
    p = trainer.progress
    numbers = [torch.tensor(float(v), dtype=torch.float64, device=device) for v in (p.epoch, p.position, p.step)]
    zero = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        params = list(trainer.model.parameters())
        state = [
            t
            for s in trainer.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        for tensors in (params, state):  # reduced in float64 without a float64 copy of each tensor
            numbers.append(sum((t.sum(dtype=torch.float64).to(device) for t in tensors), zero))
            squares = (torch.linalg.vector_norm(t, dtype=torch.float64).square().to(device) for t in tensors)
            numbers.append(sum(squares, zero))
    values = torch.stack(numbers)
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = len(numbers)
    if not torch.equal(both[:n], -both[n:]):
        raise RuntimeFailure.at(
            None,
            None,
            f"the survivors of a lost peer disagree on where training stands (epoch, position, step: {p.epoch}, "
            f"{p.position}, {p.step})",
        )


def _wait_for_order(env: DistEnv, control: Path | None) -> Handoff:
    """The recovery handoff: rank 0 takes it from its control file and publishes it in the store."""
    assert env.master_addr is not None and env.master_port is not None
    store = rendezvous_store(env.master_addr, env.master_port, env.rank == 0)
    key = f"g{env.generation}/{RECOVER}"
    if env.rank == 0:
        data = _take_order(control)
        store.set(key, json.dumps(data).encode())
    else:
        while True:
            try:
                store.wait([key], STORE_WAIT)  # wakes the moment rank 0 publishes it
                break
            except dist.DistStoreError:  # not yet: wait again (a stop signal gets in between); a lost store
                continue  # raises DistNetworkError, which ends this trainer
        raw = store.get(key)
        if len(raw) > MAX_BYTES:
            raise RuntimeFailure.at(None, None, f"a recovery order of {len(raw)} bytes")
        data = json.loads(raw)
    return Handoff.from_json(data, "recovery order")


def _take_order(control: Path | None) -> dict[str, Any]:
    """Rank 0 waits for ``{"when": "recover", "handoff": ...}`` in its control file, and takes it out."""
    if control is None:
        raise RuntimeFailure.at(None, None, "a peer was lost, and rank 0 has no control file to be told what next")
    while True:
        order = _order_in(control)
        if order is not None:
            with contextlib.suppress(OSError):
                os.replace(control, control.with_name(control.name + ".taken"))
            return order
        time.sleep(POLL_S)


def _order_in(control: Path) -> dict[str, Any] | None:
    try:
        request = json.loads(control.read_text())
    except (OSError, ValueError):
        return None
    order = request.get("handoff") if isinstance(request, dict) and request.get("when") == RECOVER else None
    return order if isinstance(order, dict) else None
