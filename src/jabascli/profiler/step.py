"""The measured training steps: ``n`` VSWs of a workload on one device, phase by phase.

Two steps live here:

* :class:`EngineStep`, what ``jabas profile comp`` times: one rank of the
  engine itself (:class:`~jabascli.engine.trainer.Trainer`) in a one-process
  group, reporting the phases of :mod:`jabascli.engine.timing`. Whatever the
  engine does in an iteration (DDP and its hook, the VSW strategy, exact
  BatchNorm statistics, seeding and loading every micro-batch) is measured,
  so the performance model is fitted to the iteration that will run;
* :class:`VswStep`, what memory trials run: the seed's step, one model replica
  per VSW with every VSW's activations alive at once (as when VSWs overlap on
  CUDA streams), the conservative bound on how many VSWs fit. The engine's
  strategies (:mod:`jabascli.engine.vsw`) run each micro-step's forward and
  backward together, so how many activations are alive at once there depends
  on how the streams overlap; this step holds the case where all of them are.

One iteration of :class:`VswStep` is:

``data``
    take ``n`` batches of LBS samples and move them to the device;
``fwd``
    the forward pass and loss of every VSW;
``bwd``
    the backward pass of every VSW;
``copy``
    what exists only because there are several VSWs: sum the replicas'
    gradients into replica 0 (scaled to their mean) before the update, and
    copy the updated parameters back to the other replicas after it. Exactly 0
    for one VSW. (The seed timed only the copy back; its gradient sum ran
    inside its patched DDP's all-reduce.)
``update``
    the optimizer step on replica 0.

Each VSW has its own model replica, as in the seed, where VSWs run
concurrently on CUDA streams: so memory grows with the VSW count. All forward
passes run before the backward passes, so every VSW's activations are alive
at once, as they are when the streams overlap. On CUDA each replica runs on
its own stream; on the CPU the replicas run in turn.

BatchNorm statistics are per replica (per micro-batch), and nothing is
synchronised between devices here: ``bn_sync_time`` is not measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jabascli.engine.data import to_device
from jabascli.engine.timing import PHASES as ENGINE_PHASES
from jabascli.engine.timing import PhaseTimer
from jabascli.engine.vsw import make_replicas
from jabascli.workload import Workload

PHASES = ENGINE_PHASES  # data, fwd, bwd, copy, update, overhead

Batch = tuple[Any, Any]


@dataclass(frozen=True)
class StepTimes:
    """Milliseconds spent in each phase of one iteration."""

    data: float
    fwd: float
    bwd: float
    copy: float
    update: float
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.data + self.fwd + self.bwd + self.copy + self.update + self.overhead


def synthetic_batches(workload: Workload, lbs: int) -> Iterator[Batch]:
    """Endless synthetic batches from the workload (what memory trials use)."""
    while True:
        yield workload.synthetic_batch(lbs)


def dataset_batches(workload: Workload, lbs: int, seed: int = 0) -> Iterator[Batch]:
    """Endless batches of ``lbs`` samples drawn from the training set, as training loads them.

    Sampling with replacement gives full batches even from a data set smaller
    than the batch.
    """
    from torch.utils.data import DataLoader, RandomSampler

    dataset = workload.train_dataset()
    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(dataset, replacement=True, num_samples=lbs * 1024, generator=generator)
    loader = DataLoader(dataset, batch_size=lbs, sampler=sampler, collate_fn=workload.collate, drop_last=True)
    while True:
        yield from loader


def _record_stream(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _record_stream(o, stream)
    elif isinstance(obj, dict):
        for o in obj.values():
            _record_stream(o, stream)


class _CpuClock:
    """Wall-clock marks: the CPU runs every phase synchronously."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def finish(self) -> None:
        pass


class _CudaClock:
    """CUDA events on the current stream; read after one synchronisation per iteration."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def finish(self) -> None:
        torch.cuda.synchronize()


class VswStep:
    """``num_models`` replicas of the workload's model, trained one iteration at a time."""

    def __init__(
        self,
        workload: Workload,
        lbs: int,
        num_models: int,
        device: str | torch.device = "cpu",
        batches: Iterator[Batch] | None = None,
        seed: int = 0,
        precision: str = "fp32",
    ) -> None:
        from jabascli.engine.step_policy import Precision

        if num_models < 1:
            raise ValueError(f"num_models must be at least 1, got {num_models}")
        self.workload = workload
        self.lbs = lbs
        self.num_models = num_models
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.batches = batches if batches is not None else synthetic_batches(workload, lbs)
        torch.manual_seed(seed)
        main = workload.build_model().to(self.device)
        main.train()
        self.replicas = make_replicas(main, num_models)
        self.params = [[p for p in r.parameters() if p.requires_grad] for r in self.replicas]
        self.optimizer = workload.optimizer(self.params[0])
        self.clock: _CpuClock | _CudaClock = _CudaClock() if self.cuda else _CpuClock()
        self.streams = [torch.cuda.Stream(self.device) for _ in self.replicas] if self.cuda else []
        self.last_losses: list[float] = []
        self.precision = Precision(precision, self.device)  # autocast, as the engine runs the forward

    def _next_batches(self) -> list[Batch]:
        return [to_device(next(self.batches), self.device) for _ in self.replicas]

    def _forward(self, index: int, batch: Batch) -> torch.Tensor:
        inputs, target = batch
        model = self.replicas[index]
        with self.precision.autocast():
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            return self.workload.loss(output, target)

    def run(self) -> StepTimes:
        """One training iteration; the time of each phase."""
        clock = self.clock
        if self.cuda:
            torch.cuda.synchronize(self.device)
        # Data: the host work of loading is part of it, so it is timed on the host.
        t0 = time.perf_counter()
        batches = self._next_batches()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        data_ms = (time.perf_counter() - t0) * 1e3

        start = clock.mark()
        losses = []
        if self.cuda:
            main_stream = torch.cuda.current_stream(self.device)
            for i, stream in enumerate(self.streams):
                stream.wait_stream(main_stream)
                _record_stream(batches[i], stream)  # allocated on the main stream, used on this one
                with torch.cuda.stream(stream):
                    losses.append(self._forward(i, batches[i]))
            for stream in self.streams:
                main_stream.wait_stream(stream)
        else:
            losses = [self._forward(i, batch) for i, batch in enumerate(batches)]
        after_fwd = clock.mark()

        # Each replica's backward runs on the stream its forward ran on.
        torch.autograd.backward(losses)
        after_bwd = clock.mark()

        self._sum_gradients()
        after_sum = clock.mark()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        after_update = clock.mark()
        self._copy_parameters()
        after_copy = clock.mark()
        clock.finish()
        self.last_losses = [float(loss.detach()) for loss in losses]

        copy_ms = 0.0
        if self.num_models > 1:
            copy_ms = clock.elapsed_ms(after_bwd, after_sum) + clock.elapsed_ms(after_update, after_copy)
        return StepTimes(
            data=data_ms,
            fwd=clock.elapsed_ms(start, after_fwd),
            bwd=clock.elapsed_ms(after_fwd, after_bwd),
            copy=copy_ms,
            update=clock.elapsed_ms(after_sum, after_update),
        )

    @torch.no_grad()
    def _sum_gradients(self) -> None:
        """Replica 0's gradients become the mean over replicas; the others' are freed."""
        if self.num_models == 1:
            return
        main = self.params[0]
        for params in self.params[1:]:
            pairs = [(p0, p) for p0, p in zip(main, params, strict=True) if p.grad is not None]
            for p0, p in pairs:
                if p0.grad is None:
                    p0.grad = p.grad
            mine = [p0.grad for p0, p in pairs if p0.grad is not p.grad]
            theirs = [p.grad for p0, p in pairs if p0.grad is not p.grad]
            if mine:
                torch._foreach_add_(mine, theirs)
            for p in params:
                p.grad = None
        grads = [p.grad for p in main if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(self.num_models))

    @torch.no_grad()
    def _copy_parameters(self) -> None:
        """The updated parameters of replica 0, copied to the others."""
        for params in self.params[1:]:
            for dst, src in zip(params, self.params[0], strict=True):
                dst.copy_(src)


def time_iterations(
    step: VswStep, count: int, on_iteration: Callable[[int, StepTimes], None] | None = None
) -> list[StepTimes]:
    """Run ``count`` iterations; their times."""
    times = []
    for i in range(count):
        times.append(step.run())
        if on_iteration is not None:
            on_iteration(i, times[-1])
    return times


class WallPhases(PhaseTimer):
    """Phase times on the host clock (the CPU runs every phase synchronously)."""

    timer = "perf_counter"

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._ms = dict.fromkeys(ENGINE_PHASES, 0.0)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._ms[phase] += (now - self._last) * 1e3
        self._last = now

    def take(self) -> StepTimes:
        """The phase times since the last ``take``."""
        times, self._ms = self._ms, dict.fromkeys(ENGINE_PHASES, 0.0)
        return StepTimes(**times)


class CudaPhases(PhaseTimer):
    """Phase times from CUDA events on the current stream, read once per iteration."""

    timer = "cuda-events"

    def __init__(self) -> None:
        self._last = self._event()
        self._marks: list[tuple[str, Any]] = []

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._event()))

    def take(self) -> StepTimes:
        torch.cuda.synchronize()
        ms = dict.fromkeys(ENGINE_PHASES, 0.0)
        for phase, event in self._marks:
            ms[phase] += float(self._last.elapsed_time(event))
            self._last = event
        self._marks = []
        return StepTimes(**ms)


def phase_timer(device: torch.device) -> WallPhases | CudaPhases:
    """A recording phase timer for a trainer on ``device``: CUDA events on a GPU, the host clock elsewhere."""
    return CudaPhases() if device.type == "cuda" else WallPhases()


class EngineStep:
    """One rank of the engine on its own: ``num_models`` VSWs at one LBS, timed phase by phase.

    A :class:`~jabascli.engine.trainer.Trainer` for a one-rank plan (``num_models``
    VSWs, no GA, ``sequential`` weight sync, the VSW strategy ``vsw_strategy``
    resolves to on this device, DDP's default buckets) in a one-process group,
    which the caller must have initialised (``init_process_group``). Each
    :meth:`run` is one ``train_step`` on ``num_models`` micro-batches of ``lbs``
    samples drawn at random (with replacement, so any LBS gets full batches)
    from the training set, or of the workload's synthetic batches. The
    all-reduce of a one-process group is a copy at most: the performance model
    adds the real one from the communication profile. ``slowdown`` above 1 runs
    the rank as the engine runs an emulated device (:class:`~jabascli.engine.vsw.Emulation`),
    sleeps included, so the times are what such a trainer takes.
    """

    def __init__(
        self,
        workload: Workload,
        lbs: int,
        num_models: int,
        device: str | torch.device = "cpu",
        *,
        vsw_strategy: str = "auto",
        weight_sync: str = "sequential",
        synthetic: bool = False,
        seed: int = 0,
        slowdown: float = 1.0,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
    ) -> None:
        from jabascli.config.loader import LoadedConfig
        from jabascli.config.models import JabasConfig, JobConfig
        from jabascli.engine.options import TrainOptions
        from jabascli.engine.plan import RankPlan, TrainingPlan
        from jabascli.engine.trainer import Trainer

        if num_models < 1:
            raise ValueError(f"num_models must be at least 1, got {num_models}")
        self.workload, self.lbs, self.num_models = workload, lbs, num_models
        self.device = torch.device(device)
        options = {k: v for k, v in workload.options.items() if k != "data"}  # load_workload adds "data"
        job = JobConfig(
            name="profile",
            workload=str(workload.path),
            data=workload.options.get("data"),
            options=options,
            seed=seed,
            weight_sync=weight_sync,  # type: ignore[arg-type]
            vsw_strategy=vsw_strategy,  # type: ignore[arg-type]
            precision=precision,  # type: ignore[arg-type]
            clip_grad_norm=clip_grad_norm,
            loader_workers=0,  # it feeds the trainer's iterations itself; its data phase is in-process loading
        )
        loaded = LoadedConfig(JabasConfig(job=job), Path("jabas profile comp"), "toml")
        rank = RankPlan(0, "profile", "profile", num_models, 0, slowdown, emulated=slowdown > 1)
        plan = TrainingPlan(lbs, (rank,), weight_sync)
        self.trainer = Trainer(loaded, plan, 0, self.device, TrainOptions(metrics=False))
        if synthetic:
            self.trainer.worker_step.load = _SyntheticLoader(workload, lbs, self.device)  # type: ignore[assignment]
        self.size = len(self.trainer.train_set)
        self.generator = torch.Generator().manual_seed(seed)
        self.phases = phase_timer(self.device)
        self.trainer.set_timer(self.phases)
        self.last_loss = float("nan")

    @property
    def vsw_strategy(self) -> str:
        """The VSW strategy the trainer chose (``sequential`` or ``streams``)."""
        return self.trainer.workers.vsw_name

    def _iteration(self) -> Any:
        from jabascli.engine.sampler import Iteration, MicroBatch

        batches = []
        for v in range(self.num_models):
            indices = torch.randint(self.size, (self.lbs,), generator=self.generator).tolist()
            seed = int(torch.randint(2**62, (), generator=self.generator))
            batches.append(MicroBatch(v, v, 0, 0, indices, seed))
        return Iteration(0, 0, batches)

    def run(self) -> StepTimes:
        """One training iteration of the engine; the time of each phase."""
        iteration = self._iteration()
        self.phases.take()  # drawing the samples is the profiler's, not the engine's
        self.phases.mark("overhead")
        loss = self.trainer.train_step(iteration)
        times = self.phases.take()
        self.last_loss = float(loss)
        return times


class _SyntheticLoader:
    """The workload's synthetic batches instead of the training set (``--synthetic-data``)."""

    def __init__(self, workload: Workload, lbs: int, device: torch.device) -> None:
        self.workload, self.lbs, self.device = workload, lbs, device

    def __call__(self, indices: Any) -> tuple[Any, Any]:
        inputs, target = self.workload.synthetic_batch(len(indices))
        return to_device(inputs, self.device), to_device(target, self.device)
