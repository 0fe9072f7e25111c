"""A trainer process's life: from ``jabas train`` to its exit, across moves in place and layout changes.

:func:`run_trainer` joins the process group from the environment
(:mod:`jabascli.engine.distributed`), builds a :class:`~jabascli.engine.trainer.Trainer`
for the plan, trains, and leaves. When a stop hands the job over to a next
generation that keeps this rank (:mod:`jabascli.engine.handoff`), or adaptive
batching goes on under another layout (:mod:`jabascli.engine.relayout`), the same
process builds the next trainer, resumed from the checkpoint just written. SIGTERM
raises SystemExit, so that cleanups run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import signal
import threading
import weakref
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from jabascli.adaptive.checks import check_batching
from jabascli.config import LoadedConfig
from jabascli.engine.distributed import (
    DistEnv,
    choose_device,
    init_process_group,
    rejoin,
    release_retired,
    wait_for_generation,
)
from jabascli.engine.events import EventSink
from jabascli.engine.host_memory import keep_freed_memory
from jabascli.engine.inputs import fresh_model, take_prepared
from jabascli.engine.layout import checkpoint_folder, run_folder
from jabascli.engine.metrics import EpochResult, MetricsWriter, open_metrics
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan, plan_from_dict
from jabascli.engine.precision_checks import check_job_precision_inputs
from jabascli.engine.recovery import check_agreement, lost_peer
from jabascli.engine.trainer import Trainer
from jabascli.errors import InputError, JabasError


def run_trainer(
    loaded: LoadedConfig,
    options: TrainOptions | None = None,
    on_event: EventSink | None = None,
    environ: dict[str, str] | None = None,
) -> list[EpochResult]:
    """Run this process's rank of the job to its end; the entry point of ``jabas train``.

    Joins the process group from the environment (see
    :mod:`jabascli.engine.distributed`), trains, and leaves it. When a stop
    hands the job over to a next generation that keeps this rank
    (:mod:`jabascli.engine.handoff`), it trains on there, resumed from the
    checkpoint just written. Any failure is also sent as an ``error`` event
    before it propagates.
    """
    options = options or TrainOptions()
    keep_freed_memory()  # every iteration reuses the last one's pages (engine/host_memory.py)
    env = DistEnv.from_environ(environ)
    created = False
    trainer: Trainer | None = None
    metrics: MetricsWriter | None = None
    results: list[EpochResult] = []
    try:
        with _sigterm_raises():
            plan = load_plan(loaded, options.plan)
            device = choose_device(plan, env)
            inputs = take_prepared(loaded)
            switching = False  # after a handoff: this process leaves its group for the next generation's
            written: dict | None = None  # after a handoff: the checkpoint as rank 0 just wrote it
            recovering = False  # after a lost peer: this process's own state, kept in memory
            while True:
                plan.check_world_size(env.world_size)
                check_job_precision_inputs(loaded, plan)  # every rank, so that all of them stop
                check_batching(loaded, plan)  # `jabas run` did already; not plain torchrun
                trainer = Trainer(loaded, plan, env.rank, device, options, on_event, inputs, connect=False)
                if on_event is not None and env.generation is not None and env.rank != 0:
                    # Built: a rank started ahead of a move says so; the move's stop waits for it.
                    on_event({"event": "ready", "generation": env.generation, "rank": env.rank})
                wait_for_generation(env)  # a rank started for a move waits here for the checkpoint ...
                trainer.restore(written)  # ... which every rank of the generation reads before the group forms
                written = None
                timeout = timedelta(seconds=loaded.config.scheduler.collective_timeout_s)
                if switching:
                    rejoin(env, device, timeout)
                else:
                    created = init_process_group(env, device, timeout) or created
                trainer.connect()
                if recovering:
                    check_agreement(trainer, device)  # the survivors of a lost peer hold one state
                    recovering = False
                if metrics is None:
                    metrics = open_metrics(run_folder(loaded), trainer.rank, options.metrics)  # kept across moves
                try:
                    results += trainer.fit(metrics)
                except Exception as exc:
                    # A lost peer (engine/recovery.py): wait for the controller's order, or raise as always.
                    survivor = lost_peer(trainer, env, exc, on_event)
                    if survivor is None:
                        raise
                    # While the report travels and the controller decides: the old trainer goes (a reference
                    # cycle holds it), and the next one's model is built (it depends on neither plan nor world).
                    inputs, trainer = trainer.inputs(), None
                    gc.collect()
                    model = fresh_model(inputs.workload, loaded.config.job.seed, device)
                    order = survivor.wait_for_order()
                    if order.env is None:
                        return results  # its server is left out of the next generation
                    inputs = dataclasses.replace(inputs, model=model)
                    written, env = survivor.payload, order.env
                    plan = plan_from_dict(order.handoff.plan, loaded, "recovery order")
                    options = dataclasses.replace(options, resume=checkpoint_folder(loaded))  # read from memory
                    if on_event is not None:
                        on_event({"event": "handoff", "generation": env.generation, "rank": env.rank})
                    switching = recovering = True
                    continue
                unfinished = trainer.progress.epoch < trainer.epochs
                if trainer.goes_on_under_another_layout():
                    # Another layout (engine/relayout.py): the same ranks and group, resumed from the checkpoint.
                    assert trainer.relayout is not None
                    plan, inputs, trainer = trainer.relayout, trainer.inputs(), None
                    gc.collect()  # the old layout's model and optimizer go before the new ones are built
                    if env.world_size > 1:
                        dist.barrier()  # rank 0 alone writes a plain trainer's checkpoint: read it once written
                    options = dataclasses.replace(options, resume=checkpoint_folder(loaded))
                    switching = False  # in the group it is in
                    continue
                handoff = trainer.control.handoff() if trainer.control.stop and unfinished else None
                following = handoff.env_for(env) if handoff is not None else None
                if handoff is None or following is None:
                    return results
                # A move in place: the same process, the next generation's rank, resumed from the checkpoint.
                inputs, old_model = trainer.inputs(), weakref.ref(trainer.model)
                # Rank 0 resumes from what it has just written, without reading it back (2-3 ms of a move).
                # Not on a GPU: the old model would still hold its memory while the new one is built.
                written = trainer.saved if device.type == "cpu" else None
                trainer = None
                if old_model() is not None:
                    gc.collect()  # a reference cycle holds the old model: free it before the new one is built
                env, plan = following, plan_from_dict(handoff.plan, loaded, "handoff")
                options = dataclasses.replace(options, resume=checkpoint_folder(loaded))
                if on_event is not None:
                    on_event({"event": "handoff", "generation": env.generation, "rank": env.rank})
                wait_for_generation(env)  # rank 0 opens it: the new ranks read the checkpoint meanwhile
                switching = True
    except Exception as exc:
        if on_event is not None:
            kind = "input" if isinstance(exc, InputError) else "runtime"
            message = str(exc) if isinstance(exc, JabasError) else f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError):
                on_event({"event": "error", "rank": env.rank, "kind": kind, "message": message})
        raise
    finally:
        # Free DDP (it holds the process group) before the group goes: left to the interpreter's
        # exit, gloo's threads may be torn down out of order and abort the process.
        trainer = None
        if metrics is not None:
            metrics.close()
        gc.collect()
        release_retired()
        if created and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM (how ``jabas run`` stops trainers) into SystemExit, so cleanups run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
