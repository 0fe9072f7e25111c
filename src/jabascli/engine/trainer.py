"""One trainer rank of an IIDP job: the training loop.

Every iteration, on every rank ``r``::

    for each of the rank's VSW_r * (GA_r + 1) workers w (its micro-batch of LBS samples):
        loss_w = mean loss of the micro-batch          # normalised with its own batch statistics
        backward(loss_w / (GBS / LBS))                 # only the rank's last backward communicates
    all-reduce (SUM) every gradient bucket             # = mean over all GBS / LBS workers
    adaptive measurement (every adjust_interval)       # adaptive: first-half gradient, unscaled, unclipped
    fp16 unscale (skip on inf/NaN), clip, optimizer step   # step_policy; per bucket with overlap
    LR scheduler step
    running statistics and loss: one all-reduce      # exact, identical everywhere
    adaptive decision: maybe another plan for the next iteration (same ranks)

which is synchronous SGD at GBS: every rank ends the iteration with the same
parameters as one process that feeds the GBS samples in micro-batches of LBS
and applies the mean of their gradients once (:mod:`jabascli.engine.reference`).

Under a ``[parallel]`` layout a replica spans several ranks (FSDP2 shards, TP
slices, pipeline stages): every rank of a replica runs all of the replica's
micro-batches, the layout reduces the gradients inside backward, and the
statistics and loss take one all-reduce of their own. The loop is the same; the
layout is built in :mod:`jabascli.engine.parallel.runner` and answers the VSW
strategy's calls (docs/hybrid.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict

import torch

from jabascli.adaptive.batching import AdaptiveBatching, FixedBatching
from jabascli.adaptive.batching import build as build_adaptive
from jabascli.config import LoadedConfig
from jabascli.engine.buffers import BufferSync
from jabascli.engine.busy import BusyClock
from jabascli.engine.checkpoint import CheckpointState, Progress
from jabascli.engine.checkpointer import Checkpointer
from jabascli.engine.control import StopControl
from jabascli.engine.data import BatchLoader
from jabascli.engine.events import EventSink
from jabascli.engine.faults import FaultInjector
from jabascli.engine.inputs import Inputs, fresh_model
from jabascli.engine.layout import run_folder
from jabascli.engine.loader import MicroBatchFeed, default_loader_workers
from jabascli.engine.memory_limit import MemoryLimit
from jabascli.engine.metrics import EpochResult, MetricsWriter, open_metrics
from jabascli.engine.options import TrainOptions
from jabascli.engine.parallel.runner import (
    LayoutWorkers,
    build_layout_workers,
    check_trainer_layout_inputs,
    trainer_layout,
)
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.precision_checks import check_precision
from jabascli.engine.recovery import iteration_begins
from jabascli.engine.relayout import changes_layout
from jabascli.engine.sampler import IIDPSampler, Iteration
from jabascli.engine.step_policy import StepPolicy, step_settings
from jabascli.engine.steplog import StepLog, report_start
from jabascli.engine.timing import PhaseTimer
from jabascli.engine.validate import validate
from jabascli.engine.vsw import Emulation, WorkerStep
from jabascli.engine.workers import RankWorkers, Workers, rank_workers
from jabascli.workload import Workload, workload_of


class Trainer:
    """The state of one rank: model replicas, optimizer, sampler, progress."""

    # Built by connect(), once the process group exists:
    adaptive: AdaptiveBatching | FixedBatching
    """Adaptive GBS (:mod:`jabascli.adaptive.batching`): measures, and may choose another plan between iterations."""
    emulation: Emulation
    workers: RankWorkers
    vsw: Workers
    """``workers.workers``: what runs this rank's micro-batches (a VSW strategy, or its layout's workers)."""
    buffers: BufferSync
    control: StopControl
    busy: BusyClock
    worker_step: WorkerStep
    timer: PhaseTimer
    memory_limit: MemoryLimit

    def __init__(
        self,
        loaded: LoadedConfig,
        plan: TrainingPlan,
        rank: int,
        device: torch.device,
        options: TrainOptions,
        on_event: EventSink | None = None,
        inputs: Inputs | None = None,
        connect: bool = True,
    ) -> None:
        """``inputs``: the workload, datasets and loader workers of this process's previous trainer (a move
        in place); they do not depend on the plan or the world. ``connect`` False: build only what needs
        neither the process group nor the checkpoint; :meth:`connect` does the rest, once the group exists."""
        cfg = loaded.config
        self.loaded, self.plan, self.rank, self.device, self.options = loaded, plan, rank, device, options
        self.me = plan.rank(rank)
        self.emit = on_event if (on_event is not None and rank == 0) else None
        self.epochs = cfg.job.epochs
        self.validate_every = cfg.job.validate_every
        self.faults = FaultInjector.from_environ(rank, run_folder(loaded))

        # What to train, and where training stands.
        self.workload: Workload = inputs.workload if inputs else workload_of(loaded)
        built = inputs.model if inputs is not None else None
        model = built if built is not None else fresh_model(self.workload, cfg.job.seed, device)
        # [parallel] (docs/hybrid.md): a layout is built once the process group exists (connect).
        self.layout = trainer_layout(loaded, self.workload, model, plan.parallel)
        if self.layout is not None:
            check_trainer_layout_inputs(loaded, self.layout, model, self.workload)
        self.checkpointer = Checkpointer(loaded, rank, sharded=self.layout is not None)
        self.layout_workers: LayoutWorkers | None = None
        self.model = model
        check_precision(cfg.job.precision, device.type, loaded.path)
        self._build_optimizer()
        self.progress = Progress()

        # The data: one seeded permutation per epoch, dealt to the workers in LBS chunks.
        self.train_set = inputs.train_set if inputs else self.workload.train_dataset()
        self.val_set = inputs.val_set if inputs else self.workload.val_dataset()
        self.sampler = IIDPSampler(len(self.train_set), cfg.job.seed)  # fit() checks that GBS samples exist
        self.feed = inputs.feed if inputs is not None else None
        self._payload: dict | None = None
        """The checkpoint restored (:meth:`restore`), for the state :meth:`connect` still takes from it."""
        self._restored = False
        self.in_flight: int | None = None
        """During an iteration, the optimizer updates applied before it (engine/recovery.py)."""
        self.relayout: TrainingPlan | None = None
        """A plan under another layout that adaptive batching chose: the trainer stops after the iteration and
        its process goes on under it from the checkpoint (:mod:`jabascli.engine.relayout`)."""
        self.saved: dict | None = None
        """What rank 0 last wrote to the checkpoint: the live model's and optimizer's tensors, so the
        file's content only until the next iteration (after a stop, the state a handoff resumes)."""
        if connect:
            self.restore()
            self.connect()

    def _build_optimizer(self) -> None:
        """The optimizer and LR scheduler over the model's parameters, and how the reduced gradient becomes an
        update: precision and clipping (engine/step_policy.py)."""
        cfg, params = self.loaded.config, list(self.model.parameters())
        self.optimizer = self.workload.optimizer(params)
        self.scheduler = self.workload.lr_scheduler(self.optimizer)
        clip = self.layout_workers.clip_grad_norm if self.layout_workers is not None else None
        self.step_policy = StepPolicy(step_settings(cfg.job, self.workload), self.optimizer, params, self.device, clip)

    def _build_layout(self) -> None:
        """Parallelise the model for its layout (a collective); the optimizer then takes its parameters."""
        assert self.layout is not None
        self.layout_workers = build_layout_workers(self.model, self.workload, self.layout, self.device)
        self.model = self.layout_workers.model
        self._build_optimizer()

    def restore(self, written: dict | None = None) -> None:
        """Resume where training stands: the model, optimizer, LR scheduler and progress of the checkpoint.

        A rank started ahead of a move builds its model and data first (``connect=False``) and
        comes here once its generation opens, when the checkpoint it resumes is written.
        ``written``: the checkpoint's content as this process wrote it (:attr:`saved`), instead of
        reading the file back.
        """
        options = self.options
        if options.resume is None or self._restored:
            return
        if self.layout is not None and self.layout_workers is None:
            return  # a layout's checkpoint is read by all ranks together, into the built layout (connect)
        self._restored = True
        resume, live = options.resume, (self.model, self.optimizer, self.scheduler)
        payload, self.progress = self.checkpointer.restore(resume, *live, written=written)
        self._payload = payload
        self.step_policy.load_state_dict(payload.get("grad_scaler") or {})

    def connect(self) -> None:
        """Take this rank's place in the process group: the plan to start from, VSW replicas, DDP."""
        loaded, plan, rank, device = self.loaded, self.plan, self.rank, self.device
        if self.layout is not None and self.layout_workers is None:
            self._build_layout()
        cfg, model = loaded.config, self.model
        self.restore()
        payload, self._payload = self._payload, None  # not kept: after a move, the old model's tensors

        # Adaptive GBS (jabascli.adaptive): it may start from another plan (initial_gbs, a resumed GBS),
        # and scales the LR that the workload's scheduler sets.
        replica = self.layout_workers.replica if self.layout_workers is not None else None
        self.adaptive = build_adaptive(
            loaded, plan, rank, len(self.train_set), self.optimizer, self.scheduler, list(model.parameters()), replica
        )
        self.scheduler = self.adaptive.scheduler
        start = self.adaptive.plan_to_start(plan, payload.get("adaptive") if payload else None)
        if changes_layout(plan, start):
            # The hybrid planner runs the GBS resumed (or initial_gbs) under another layout than this one was
            # built for: stop before the first iteration and go on under it (engine/relayout.py).
            self.relayout = start
        else:
            plan = self.plan = start
        self.me = plan.rank(rank)
        self._record_plan(start)

        # How this rank runs its workers and combines gradients (engine/workers.py).
        self.emulation = Emulation(self.me.slowdown)
        dtype = next(model.parameters()).dtype  # the loss's: what rides in the same all-reduce is of it
        self.busy = BusyClock(rank, plan.world_size, dtype, device)  # marked by the communication hook
        self.workers = rank_workers(self, same_start=payload is not None)
        self.adaptive.trains_with(self.workers.weight_sync)
        self.vsw = self.workers.workers
        self.buffers = self.workers.start(plan)
        self.buffers.broadcast_all()
        self.vsw.after_step()  # replicas start from the broadcast parameters
        self.control = StopControl.from_environment(rank, dtype, device, self.emit)  # an outside stop request
        self.buffers.riders += [self.control.flag, self.busy.times]
        load = BatchLoader(self.train_set, device, self.workload.collate)
        workers = default_loader_workers(cfg.job.loader_workers, device)  # 0: load in this process
        if self.feed is None and workers:
            self.feed = MicroBatchFeed(self.train_set, self.workload.collate, device, workers)
        self.worker_step = WorkerStep(
            self.workload.loss,
            load,
            plan.workers,
            self.buffers,
            self.emulation,
            plan.loss_weight(rank),
            precision=self.step_policy.precision,
            feed=self.feed,
            observer=self.adaptive.observer,
        )
        self.timer = PhaseTimer()
        # Emulated devices: out of memory as the GPU would be, over the first iterations (engine/memory_limit.py).
        self.memory_limit = MemoryLimit(self.me.memory_bytes, f"{self.me.server} ({self.me.device_type}), rank {rank}")
        self.memory_limit.start(self.vsw.replicas, self.optimizer, self.vsw.keeps_gradients)

    def inputs(self) -> Inputs:
        return Inputs(self.workload, self.train_set, self.val_set, self.feed)

    def set_timer(self, timer: PhaseTimer) -> None:
        """Report phase boundaries to ``timer`` (the computation profiler's; training keeps the no-op default)."""
        self.timer = self.worker_step.timer = timer

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, metrics: MetricsWriter | None = None) -> list[EpochResult]:
        """Train to the job's end or a stop; writes to ``metrics`` if given (and open), else to its own writer."""
        self.sampler.check_gbs(self.plan)
        report_start(self)
        own = metrics is None
        metrics = open_metrics(run_folder(self.loaded), self.rank, self.options.metrics) if own else metrics
        results: list[EpochResult] = []
        try:
            while self.progress.epoch < self.epochs and not self._stop():
                result = self._train_epoch(metrics)
                if result is not None:
                    results.append(result)
            if self.control.stop:
                self.control.stopped(self.progress.step)  # after the epoch's validation, if it ended one
            self._save_checkpoint()
        finally:
            if own and metrics is not None:
                metrics.close()
        if self.emit and self.goes_on_under_another_layout():
            self.emit({"event": "relayout", "step": self.progress.step, "gbs": self.relayout.gbs})
        elif self.emit:
            done = {"event": "done", "step": self.progress.step, "stopped": self.progress.epoch < self.epochs}
            self.emit({**done, "results": [asdict(r) for r in results]})
        return results

    def _train_epoch(self, metrics: MetricsWriter | None) -> EpochResult | None:
        """Train from the current position to the end of the epoch; None when ``max_steps`` stops it first."""
        epoch = self.progress.epoch
        log = StepLog(self, metrics, self.sampler.iterations_per_epoch(self.plan.gbs))
        start = time.perf_counter()
        steps = samples = 0
        epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for iteration in self._iterations(epoch):
            self.control.before_iteration()
            self.faults.before_step(self.progress.step + 1)  # JABAS_FAULT: failures on purpose, for tests
            log.settings()  # the GBS and LR this iteration trains with, when they change
            with self.memory_limit.watch():
                loss = self.train_step(iteration)
            self.progress.position = iteration.position + self.plan.gbs
            self.progress.step += 1
            steps, samples = steps + 1, samples + self.plan.gbs
            epoch_loss += loss
            log.step(loss, self.busy.times)
            self._adapt(log)  # may switch to another plan between this iteration and the next
            epoch_end = self.sampler.iterations_left(self.progress.position, self.plan.gbs) == 0
            self.control.after_iteration(self.progress.step, epoch_end)
            if self._stop():
                break
            if self._checkpoint_due() and not epoch_end:
                self._save_checkpoint()
        log.flush()
        train_time = time.perf_counter() - start
        if self.sampler.iterations_left(self.progress.position, self.plan.gbs) > 0:
            return None
        val_loss, val_accuracy = None, None
        if (epoch + 1) % self.validate_every == 0 or epoch + 1 == self.epochs:
            val_loss, val_accuracy = self.validate()
        result = EpochResult(
            epoch=epoch,
            step=self.progress.step,
            train_loss=float(epoch_loss) / steps if steps else None,
            val_loss=val_loss,
            val_accuracy=val_accuracy,
            samples_per_s=samples / train_time if train_time > 0 else 0.0,
            time_s=train_time,
        )
        self.progress.epoch, self.progress.position = epoch + 1, 0
        log.epoch_end(result)
        if self.progress.epoch < self.epochs and not self._stop():
            self._save_checkpoint()  # at every epoch end; the last one is saved on exit
        return result

    def _iterations(self, epoch: int) -> Iterator[Iteration]:
        """This rank's iterations of ``epoch`` from the current position, dealt afresh after a plan change."""
        while True:
            plan = self.plan
            for iteration in self._stream(epoch, plan):
                yield iteration
                if self.plan is not plan:
                    break
            else:
                return

    def _stream(self, epoch: int, plan: TrainingPlan) -> Iterator[Iteration]:
        """The iterations ``plan`` deals from the current position; loader workers follow each stream afresh.

        A new stream starts a new loader iterator (:meth:`MicroBatchFeed.follow`), which drops what the
        workers had prefetched for the previous one: after a plan change no stale micro-batch is trained.
        """
        iterations = self.sampler.replica_iterations(epoch, self.progress.position, plan, self.workers.replica_ranks)
        return iterations if self.feed is None else self.feed.follow(iterations)

    def train_step(self, iteration: Iteration) -> torch.Tensor:
        """One iteration of this rank; returns the mean loss over all workers of the job."""
        timer = self.timer
        self.in_flight = iteration_begins(self)  # engine/recovery.py: what a failure in this iteration changed
        timer.mark("overhead")  # the training loop since the last iteration
        self.busy.start()
        self.vsw.zero_grad()
        self.buffers.begin()
        self.worker_step.begin()
        self.adaptive.begin(self.progress.step, iteration, self.plan, self._replica_params)
        timer.mark("overhead")
        self.vsw.run(iteration.micro_batches, self.worker_step)  # all-reduces every gradient bucket
        self.adaptive.measure(self.plan, self.step_policy.loss_scale)  # before the update unscales or clips
        if self.workers.weight_sync == "sequential":
            self.step_policy.step()  # with overlap, each bucket was already updated as its all-reduce completed
            timer.mark("update")
        if self.scheduler is not None:
            self.scheduler.step()
        timer.mark("overhead")
        self.vsw.after_step()
        timer.mark("copy")
        self.buffers.end_iteration()  # exact running statistics, and the loss summed over ranks
        timer.mark("overhead")
        loss_sum = self.worker_step.loss_sum
        assert loss_sum is not None
        self.in_flight = None
        return loss_sum.to(torch.float64) / self.plan.workers

    # -- adaptive GBS: replanning in place -------------------------------------------------------

    def _adapt(self, log: StepLog) -> None:
        p = self.progress
        report = log.adjustment if self.rank == 0 else None
        where = {"epoch": p.epoch, "position": p.position}
        plan = self.adaptive.after_step(p.step, self.plan, where, report, self.busy.times)
        if plan is not None:
            self.apply_plan(plan)

    def apply_plan(self, plan: TrainingPlan) -> None:
        """Switch to ``plan`` (same ranks) between two iterations.

        LBS, GBS and this rank's VSW and GA change; the VSW replicas are rebuilt
        (from replica 0, so with its parameters and statistics) when their count
        changes; the model, optimizer, LR scheduler, DDP and its communication
        hook are kept. The sampler deals the rest of the epoch at the new GBS, a
        new stream that loader workers follow afresh (:meth:`_stream`), and the
        emulated memory limit watches the next iterations of the new plan.
        A plan under another layout is left pending instead: the trainer stops
        after this iteration and goes on under it (:mod:`jabascli.engine.relayout`).
        """
        if changes_layout(self.plan, plan):
            self.relayout = plan
            self._record_plan(plan)
            return
        previous, self.plan, self.me = self.plan, plan, plan.rank(self.rank)
        self.buffers = self.workers.follow(plan, self.rank, self.model, self.buffers.riders)  # the stop flag too
        self.vsw = self.workers.workers
        self.worker_step.workers, self.worker_step.buffers = plan.workers, self.buffers
        self.worker_step.loss_weight = plan.loss_weight(self.rank)
        if plan is not previous:  # not when only the LR factor changed
            self.memory_limit.start(self.vsw.replicas, self.optimizer, self.vsw.keeps_gradients)
        self._record_plan(plan)

    def _record_plan(self, plan: TrainingPlan) -> None:
        """Note ``plan`` in the GBS history from this iteration on (an uneven one with its micro-batch sizes)."""
        sizes = plan.micro_batch_sizes() if plan.uneven else None
        self.progress.record_plan(plan.gbs, plan.lbs, plan.describe(), self.adaptive.lr_factor(), sizes)

    def _replica_params(self) -> list[list[torch.nn.Parameter]]:
        return [list(self.model.parameters()), *self.vsw.replica_params()]

    # -- validation ----------------------------------------------------------------------------

    def validate(self) -> tuple[float | None, float | None]:
        """Loss and accuracy over the validation set (:func:`jabascli.engine.validate.validate`)."""
        if self.val_set is None:
            return None, None
        where = (self.vsw, self.plan, self.rank, self.workers.replica_ranks, self.device)
        return validate(self.model, self.val_set, self.workload, *where)

    # -- decisions, checkpoints, reports ---------------------------------------------------------

    def goes_on_under_another_layout(self) -> bool:
        """After :meth:`fit`: whether this process trains on under :attr:`relayout` (not when the job is done or
        stopped from outside or at ``max_steps``: a stop's handoff wins, and the checkpoint holds the new plan for
        whoever resumes)."""
        stopped = self.control.stop or self._at_max_steps()
        return self.relayout is not None and self.progress.epoch < self.epochs and not stopped

    def _at_max_steps(self) -> bool:
        return self.options.max_steps is not None and self.progress.step >= self.options.max_steps

    def _stop(self) -> bool:
        return self._at_max_steps() or self.control.stop or self.relayout is not None

    def _checkpoint_due(self) -> bool:
        every = self.options.checkpoint_every
        return every is not None and self.progress.step > 0 and self.progress.step % every == 0

    def _save_checkpoint(self) -> None:
        """Rank 0 writes the whole model; under a layout every rank writes its shards (DCP), together."""
        path, saved = self.checkpointer.save(self.checkpoint_state())
        self.saved = saved if saved is not None else self.saved
        if path is not None and self.emit:
            p = self.progress
            self.emit(
                {"event": "checkpoint", "path": str(path), "epoch": p.epoch, "position": p.position, "step": p.step}
            )

    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint of this trainer holds (the live objects)."""
        plan = self.relayout or self.plan  # a pending layout's plan is what the job resumes with
        return CheckpointState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            progress=self.progress,
            workload=self.workload.name,
            config=self.loaded.config.model_dump(mode="json"),
            plan=plan.to_dict(),
            adaptive=self.adaptive.state_dict(plan),
            grad_scaler=self.step_policy.state_dict(),
        )
