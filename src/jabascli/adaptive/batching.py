"""Adaptive GBS in a running job: the trainer's hook (the launcher's is :mod:`jabascli.adaptive.checks`).

Every ``adjust_interval`` iterations (a *measurement iteration*, the one that
completes a multiple of the interval), on every rank:

1. the iteration's first-half gradient is kept and all-reduced
   (:class:`~jabascli.adaptive.measure.FirstHalf`; under a ``[parallel]`` layout
   :class:`~jabascli.adaptive.layout_measure.LayoutFirstHalf`), giving the similarity and
   the noise estimates (:mod:`~jabascli.adaptive.estimators`, smoothed by
   :class:`~jabascli.adaptive.noise.NoiseScale`). The engine reads them
   (:meth:`AdaptiveBatching.measure`) once the gradient is all-reduced and
   before the update: unscaled from fp16's loss scale, never clipped. A
   measurement with an inf or NaN (a step fp16 skips) is discarded: that
   adjustment keeps the plan;
2. rank 0 decides: the policy's target (:mod:`~jabascli.adaptive.policy`), the
   anti-flapping rule (:class:`~jabascli.adaptive.policy.Steadiness`), a plan
   for it on the same ranks (:mod:`~jabascli.adaptive.replan`) and the LR factor
   (:mod:`~jabascli.adaptive.lr_scaling`);
3. rank 0 broadcasts ``[changed, LBS, LR factor, (VSW, GA) per rank]`` (one
   small float64 tensor: integers are exact), so every rank applies the same
   plan and factor (a hybrid planner's plan's layout is the one its GBS has in
   every rank's identical candidates: :meth:`Replanner.layout_at`); the engine
   then switches plans between two iterations (another layout: through a
   checkpoint, :mod:`jabascli.engine.relayout`).

``metric = "fixed"`` builds none of this (:func:`build`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

# The trainer's hook into adaptive batching is this module: what it builds per trainer (``build``) and what the
# one-process reference follows, re-exported here. What is checked before training is adaptive/checks.py.
from jabascli.adaptive.estimators import HalfGradients
from jabascli.adaptive.estimators import half_split as half_split
from jabascli.adaptive.lr_scaling import ScaledLr, lr_factor
from jabascli.adaptive.measure import FirstHalf
from jabascli.adaptive.noise import NoiseScale
from jabascli.adaptive.online_refit import RunRefit
from jabascli.adaptive.policy import Reading, Steadiness, propose
from jabascli.adaptive.replan import Replanner, hybrid_candidates, solver_candidates
from jabascli.config import LoadedConfig
from jabascli.config.models import BatchingConfig
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import Iteration

if TYPE_CHECKING:
    from jabascli.adaptive.layout_measure import LayoutFirstHalf
    from jabascli.engine.parallel.replica import Replica

Report = Callable[[dict[str, Any]], None]
Replicas = Callable[[], Sequence[Sequence[nn.Parameter]]]


def bounds(settings: BatchingConfig, dataset_size: int) -> tuple[int, int]:
    """``[gbs_min, gbs_max]``, defaulting to 1 and the training set's size."""
    low = settings.gbs_min or 1
    high = min(settings.gbs_max or dataset_size, dataset_size)
    return low, high


def make_replanner(loaded: LoadedConfig, plan: TrainingPlan, dataset_size: int) -> Replanner:
    low, high = bounds(loaded.config.batching, dataset_size)
    hybrid = hybrid_candidates(loaded, plan, low, high)
    if hybrid:  # [parallel] plan = "auto": the hybrid planner's plans, each with its layout
        return Replanner(hybrid, low, high, plan, hybrid=True)
    return Replanner(solver_candidates(loaded, plan, low, high) or None, low, high, plan)


class AdaptiveBatching:
    """The adaptive-GBS state of one rank, and the engine-facing calls (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedConfig,
        plan: TrainingPlan,
        rank: int,
        dataset_size: int,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        params: Sequence[nn.Parameter],
        replica: Replica | None = None,
    ) -> None:
        self.loaded, self.settings, self.rank = loaded, loaded.config.batching, rank
        self.dataset_size = dataset_size
        self.low, self.high = bounds(self.settings, dataset_size)
        self.replanner = make_replanner(loaded, plan, dataset_size)
        self.refit = RunRefit(loaded) if rank == 0 and self.replanner.source == "solver" else None
        """Rank 0 refits the solver's model from the iterations it times (:mod:`jabascli.adaptive.online_refit`)."""
        self.initial_gbs = plan.gbs
        self.noise = NoiseScale()
        self.steady = Steadiness(dead_band=min(0.05, self.settings.adjust_rate / 2))
        self.lr = ScaledLr(optimizer, scheduler)
        # Under a [parallel] layout the replica's gradient lives in shards and slices, reduced inside backward.
        if replica is None:
            self.first_half: FirstHalf | LayoutFirstHalf = FirstHalf(params)
        else:  # DTensor and FSDP2: imported with the layout
            from jabascli.adaptive.layout_measure import LayoutFirstHalf

            self.first_half = LayoutFirstHalf(replica)
        self._halves: HalfGradients | None = None
        self.overhead_s = 0.0
        """Time this rank spent measuring and deciding (the measurement iterations' extra time)."""

    # -- before training -------------------------------------------------------------------------

    @property
    def scheduler(self) -> ScaledLr:
        """The workload's LR scheduler with the rule's factor applied; the engine steps this instead."""
        return self.lr

    @property
    def tap(self) -> Callable[[Sequence[torch.Tensor]], None]:
        return self.first_half.tap

    @property
    def observer(self) -> Callable[[int, Any], None]:
        return self.first_half.after_backward

    def lr_factor(self) -> float:
        return self.lr.factor

    def trains_with(self, weight_sync: str) -> None:
        """The weight sync the trainer chose: the one the iterations it times ran."""
        if self.refit is not None:
            self.refit.weight_sync = weight_sync

    def plan_to_start(self, plan: TrainingPlan, state: dict[str, Any] | None) -> TrainingPlan:
        """The plan to start with: a resumed job's (``state``: its checkpoint's), else :meth:`starting_plan`."""
        return self.starting_plan(plan) if state is None else self.resumed_plan(plan, state)

    def starting_plan(self, plan: TrainingPlan) -> TrainingPlan:
        """The plan to start from: at ``initial_gbs`` (or the plan's GBS clamped to the bounds)."""
        target = self.settings.initial_gbs or min(max(plan.gbs, self.low), self.high)
        if target != plan.gbs:
            candidate = self.replanner.plan_for(plan, target, 0)
            if candidate is not None:
                plan = candidate.plan
        self.initial_gbs = plan.gbs
        return plan

    def resumed_plan(self, plan: TrainingPlan, state: dict[str, Any]) -> TrainingPlan:
        """Restore the policy state of a checkpoint; the plan to continue with (its GBS when reachable)."""
        self.initial_gbs = int(state["initial_gbs"])
        self.noise = NoiseScale.from_state(state["noise"])
        self.steady = Steadiness.from_state(state["steady"])
        self.lr.load_lr_state(state["lr"])
        saved = state["plan"]
        shapes = [tuple(s) for s in saved["ranks"]]
        if len(shapes) == plan.world_size:
            ranks = tuple(dataclasses.replace(r, vsw=v, ga=g) for r, (v, g) in zip(plan.ranks, shapes, strict=True))
            layout = self.replanner.layout_at(int(saved["gbs"]), plan.parallel)  # the hybrid planner's for that GBS
            return dataclasses.replace(plan, lbs=int(saved["lbs"]), ranks=ranks, parallel=layout)
        candidate = self.replanner.plan_for(plan, int(saved["gbs"]), 0)
        return plan if candidate is None else candidate.plan

    # -- every iteration -------------------------------------------------------------------------

    def measuring(self, step: int) -> bool:
        """Whether the iteration after ``step`` completed iterations is a measurement iteration."""
        return (step + 1) % self.settings.adjust_interval == 0

    def begin(self, step: int, iteration: Iteration, plan: TrainingPlan, replicas: Replicas) -> None:
        """Before iteration ``step + 1``: on a measurement iteration, arm the first-half buffer.

        ``replicas()`` gives every VSW replica's parameters (called only then).
        """
        if self.measuring(step):
            start = time.perf_counter()
            self.first_half.begin(iteration, plan.workers, replicas())
            self.overhead_s += time.perf_counter() - start

    def measure(self, plan: TrainingPlan, loss_scale: Callable[[], float]) -> None:
        """Once the iteration's gradient is all-reduced, before the update: the halves, if measuring.

        ``loss_scale()`` is the factor the gradients carry (fp16's ``S``, else 1); it is divided out.
        Clipping comes later, in the update: the measurement sees the whole, unclipped gradient.
        """
        if not self.first_half.active:
            return
        start = time.perf_counter()
        halves = self.first_half.finish(plan.workers, plan.lbs)
        self._halves = None if halves is None else halves.unscaled(loss_scale())
        self.overhead_s += time.perf_counter() - start

    def after_step(
        self,
        step: int,
        plan: TrainingPlan,
        where: dict[str, int],
        report: Report | None,
        busy: torch.Tensor | None = None,
    ) -> TrainingPlan | None:
        """After ``step`` iterations: on measurement iterations, the plan to continue with if it or the LR changes.
        ``busy``: every rank's busy time in the iteration (:mod:`jabascli.engine.busy`), for the refit."""
        if self.refit is None:
            return self._after_step(step, plan, where, report)
        self.refit.ended(plan, timed=not self.measuring(step - 1), busy=busy)
        try:
            return self._after_step(step, plan, where, report)
        finally:
            self.refit.started()

    def _after_step(
        self, step: int, plan: TrainingPlan, where: dict[str, int], report: Report | None
    ) -> TrainingPlan | None:
        if step % self.settings.adjust_interval:
            return None
        start = time.perf_counter()
        halves, self._halves = self._halves, None
        event: dict[str, Any] = {}
        decision = torch.zeros(3 + 2 * plan.world_size, dtype=torch.float64)
        if self.rank == 0:
            new, event = self._decide(plan, halves)
            decision[0] = float(new is not None)
            chosen = new or plan
            decision[1], decision[2] = chosen.lbs, event["lr_factor"]
            for r, rp in enumerate(chosen.ranks):
                decision[3 + 2 * r], decision[4 + 2 * r] = rp.vsw, rp.ga
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = self.first_half.params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
            on_device = decision.to(device)
            dist.broadcast(on_device, 0)
            decision = on_device.cpu()
        values = decision.tolist()
        factor_changed = values[2] != self.lr.factor
        self.lr.set_factor(values[2])
        result = plan if factor_changed else None  # the same plan, for the history to record the new factor
        if values[0]:
            shapes = [(int(values[3 + 2 * r]), int(values[4 + 2 * r])) for r in range(plan.world_size)]
            ranks = tuple(dataclasses.replace(rp, vsw=v, ga=g) for rp, (v, g) in zip(plan.ranks, shapes, strict=True))
            lbs, gbs = int(values[1]), int(values[1]) * sum(v * (g + 1) for v, g in shapes)
            layout = self.replanner.layout_at(gbs, plan.parallel)  # the hybrid planner's may be another layout
            result = dataclasses.replace(plan, lbs=lbs, ranks=ranks, parallel=layout)
        self.overhead_s += time.perf_counter() - start
        if report is not None and event:
            report({"event": "adjustment", "step": step, **where, **event, "overhead_s": self.overhead_s})
        return result

    def _decide(self, plan: TrainingPlan, halves: HalfGradients | None) -> tuple[TrainingPlan | None, dict[str, Any]]:
        s = self.settings
        refit = self._refit(plan)
        if halves is not None and not halves.finite():
            kept = self._kept(plan, "keep: the gradient was not finite (fp16 skipped the step): no measurement")
            return None, {**kept, **refit}
        similarity = None
        grad_sq = trace = None
        if halves is not None:
            similarity = halves.similarity()
            grad_sq, trace = halves.noise()
            self.noise.update(grad_sq, trace)
        noise = self.noise.value()
        reading = Reading(similarity, noise if halves is not None else None)
        throughput = None
        if s.metric == "goodput":
            throughput = {c.plan.gbs: c.throughput or 0.0 for c in self.replanner.candidates(plan)}
        target = propose(
            s.metric,
            plan.gbs,
            reading,
            low=self.low,
            high=self.high,
            rate=s.adjust_rate,
            similarity_target=s.similarity_target,
            initial_gbs=self.initial_gbs,
            throughput=throughput,
        )
        direction = self.steady.direction(plan.gbs, target)
        new: TrainingPlan | None = None
        reason = "keep: target within the dead band" if direction == 0 else ""
        if direction == 0 and abs(target - plan.gbs) > self.steady.dead_band * plan.gbs:
            reason = "keep: a reversal needs two adjustments in a row"
        if direction:
            candidate = self.replanner.plan_for(plan, target, direction)
            if candidate is None:
                side = "above" if direction > 0 else "below"
                reason = f"keep: no plan for these ranks reaches a GBS {side} {plan.gbs} within the bounds"
            else:
                new = candidate.plan
                self.steady.changed(direction)
                reason = "grow" if direction > 0 else "shrink"
        gbs = (new or plan).gbs
        factor = lr_factor(s.lr_scaling, gbs, self.initial_gbs, noise)
        event = {
            "metric": s.metric,
            "similarity": similarity,
            "noise_scale": noise,
            "grad_sq": grad_sq,
            "trace": trace,
            "target_gbs": target,
            "old_gbs": plan.gbs,
            "new_gbs": gbs,
            "old_lbs": plan.lbs,
            "new_lbs": (new or plan).lbs,
            "plan": (new or plan).describe(),
            "changed": new is not None,
            "reason": reason,
            "source": self.replanner.source,
            "lr_factor": factor,
            **refit,
        }
        return new, event

    def _refit(self, plan: TrainingPlan) -> dict[str, Any]:
        """Rank 0, at a decision: refit the model from ``plan``'s timed iterations when there are enough, and build
        the solver's candidates again on it; the adjustment event's ``refit`` field (empty when none was made)."""
        if self.refit is None or not self.refit.ready:
            return {}
        current = [(r.vsw, r.ga) for r in plan.ranks]
        predicted = next(
            (
                c.plan.gbs / c.throughput
                for c in self.replanner.candidates(plan)
                if c.throughput and c.plan.lbs == plan.lbs and [(r.vsw, r.ga) for r in c.plan.ranks] == current
            ),
            None,
        )
        learned = self.refit.learn(plan, predicted)
        if learned is None:
            return {}
        candidates = solver_candidates(self.loaded, plan, self.low, self.high)
        if candidates:
            self.replanner = Replanner(candidates, self.low, self.high, self.replanner.start)
        observed = learned.record.observations[-1]
        return {
            "refit": {
                "generation": learned.record.generation,
                "path": str(learned.path),
                "measured_s": observed.measured_s,
                "iterations": observed.iterations,
                "predicted_before_s": predicted,
                "predicted_after_s": learned.predicted_after_s,
                "disturbed": observed.disturbed,
            }
        }

    def _kept(self, plan: TrainingPlan, reason: str) -> dict[str, Any]:
        """The event of an adjustment that measured nothing and changes nothing."""
        return {
            "metric": self.settings.metric,
            "similarity": None,
            "noise_scale": self.noise.value(),
            "grad_sq": None,
            "trace": None,
            "target_gbs": plan.gbs,
            "old_gbs": plan.gbs,
            "new_gbs": plan.gbs,
            "old_lbs": plan.lbs,
            "new_lbs": plan.lbs,
            "plan": plan.describe(),
            "changed": False,
            "reason": reason,
            "source": self.replanner.source,
            "lr_factor": self.lr.factor,
        }

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self, plan: TrainingPlan) -> dict[str, Any]:
        return {
            "metric": self.settings.metric,
            "initial_gbs": self.initial_gbs,
            "noise": self.noise.state_dict(),
            "steady": self.steady.state_dict(),
            "lr": self.lr.lr_state(),
            "plan": {"gbs": plan.gbs, "lbs": plan.lbs, "ranks": [[r.vsw, r.ga] for r in plan.ranks]},
        }


class FixedBatching:
    """``metric = "fixed"``: the same calls, doing nothing; the GBS of the plan never changes."""

    tap = None
    observer = None

    def __init__(self, scheduler: Any | None) -> None:
        self.scheduler = scheduler

    def plan_to_start(self, plan: TrainingPlan, state: dict[str, Any] | None) -> TrainingPlan:
        return plan

    def begin(self, step: int, iteration: Iteration, plan: TrainingPlan, replicas: Replicas) -> None:
        pass

    def measure(self, plan: TrainingPlan, loss_scale: Callable[[], float]) -> None:
        pass

    def after_step(
        self,
        step: int,
        plan: TrainingPlan,
        where: dict[str, int],
        report: Report | None,
        busy: torch.Tensor | None = None,
    ) -> TrainingPlan | None:
        return None

    def lr_factor(self) -> float:
        return 1.0

    def trains_with(self, weight_sync: str) -> None:
        pass

    def state_dict(self, plan: TrainingPlan) -> dict[str, Any] | None:
        return None


def build(
    loaded: LoadedConfig,
    plan: TrainingPlan,
    rank: int,
    dataset_size: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    params: Sequence[nn.Parameter],
    replica: Replica | None = None,
) -> AdaptiveBatching | FixedBatching:
    """The hook for a job; :class:`FixedBatching` with ``metric = "fixed"``. ``replica``: this rank's part of a
    ``[parallel]`` layout's replica, measured by :class:`~jabascli.adaptive.layout_measure.LayoutFirstHalf`."""
    if loaded.config.batching.metric == "fixed":
        return FixedBatching(scheduler)
    return AdaptiveBatching(loaded, plan, rank, dataset_size, optimizer, scheduler, params, replica)
