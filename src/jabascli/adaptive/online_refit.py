"""Refits during a run: an adaptive job's performance model learns from the iterations rank 0 times.

An adaptive job changes its plan as its GBS moves, so one median over a whole run says nothing about any one
plan (``jabas run`` refits a fixed-GBS run once, at its end: :func:`jabascli.cli.run_plan.report_predicted`).
Instead rank 0 times each iteration of the plan it trains, from the end of one GBS decision point to the next
(``after_step``), so the decisions' own time is not counted, with every rank's busy time of the iteration
(:mod:`jabascli.engine.busy`, kept on the device until it is learned from). It leaves out the first
iteration of each plan (its replicas, buckets and allocator warm up) and the measurement iterations (they
carry the gradient-noise measurement, :mod:`jabascli.adaptive.batching`). At each GBS decision, once the plan has
:data:`MIN_ITERATIONS` timed iterations not learned from yet, they become one observation::

    observation = (the plan, the median of its timed iterations, their count, what the model that chose it predicted,
                   each GPU group's median busy time)

It joins the job's observations through :func:`jabascli.solver.online.learn`: the same fit, prior and refit
generation (``<run>/perfmodel/refit-N.json``) as after a run, never written over the profiles. The solver's
candidates are then built again on the refit model, so the goodput this decision weighs and the plan it picks,
and every later one, come from what the job measured.

Rank 0 alone learns and decides, and broadcasts the plan it chose (as every decision). Only the solver's
candidates are refit: the hybrid planner's layout for a GBS is looked up on every rank
(:meth:`~jabascli.adaptive.replan.Replanner.layout_at`), which a refit on one rank would make disagree, and the
fallback has no model to refit.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from jabascli.config import LoadedConfig
from jabascli.engine.busy import rank_medians
from jabascli.engine.plan import TrainingPlan
from jabascli.errors import InputError
from jabascli.profiles.refit import ObservedPlan
from jabascli.solver.online import Learned, host_disturbed, learn, observed_assignments

MIN_ITERATIONS = 10
"""Timed iterations of one plan before they are learned from: fewer say more about the host's noise."""


class RunRefit:
    """Rank 0's clock of the plan it trains, and the refit made from it at a GBS decision."""

    def __init__(self, loaded: LoadedConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.loaded = loaded
        self.clock = clock
        self.weight_sync: str | None = None
        """The weight sync the trainer runs (the model predicts each differently); set once the trainer chose it."""
        self.times: list[float] = []
        """Timed iterations of the current plan not learned from yet, in seconds."""
        self.busy: list[torch.Tensor] = []
        """Every rank's busy times of those iterations (where measured)."""
        self._plan: TrainingPlan | None = None
        self._started: float | None = None

    def ended(self, plan: TrainingPlan, timed: bool, busy: torch.Tensor | None = None) -> None:
        """An iteration of ``plan`` ended now; ``timed``: it counts (not a measurement iteration); ``busy``: every
        rank's busy time in it (:attr:`~jabascli.engine.busy.BusyClock.times`, written over by the next one)."""
        now = self.clock()
        if plan != self._plan:  # a new plan: its first iteration warmed it up
            self._plan, self.times, self.busy = plan, [], []
        elif timed and self._started is not None:
            self.times.append(now - self._started)
            if busy is not None:
                self.busy.append(busy.clone())
        self._started = None

    def started(self) -> None:
        """The next iteration starts now (after the decision point's own work)."""
        self._started = self.clock()

    @property
    def ready(self) -> bool:
        """Whether there are :data:`MIN_ITERATIONS` timed iterations, of a weight sync the model predicts."""
        return len(self.times) >= MIN_ITERATIONS and self.weight_sync in ("sequential", "overlap")

    def learn(self, plan: TrainingPlan, predicted_s: float | None) -> Learned | None:
        """Refit from ``plan``'s timed iterations once :attr:`ready`; None until then, or when the profiles cannot
        be read or the refit written."""
        if not self.ready:
            return None
        assert self.weight_sync is not None
        load = os.getloadavg()[0]
        this = ObservedPlan(
            lbs=plan.lbs,
            weight_sync=self.weight_sync,
            assignments=observed_assignments(plan.to_solver_plan(), rank_medians(self.busy)),
            measured_s=statistics.median(self.times),
            iterations=len(self.times),
            disturbed=host_disturbed(load, plan.world_size, os.cpu_count() or 1),
            load=load,
            predicted_s=predicted_s,
            time=round(time.time(), 3),
        )
        self.times, self.busy = [], []
        try:
            return learn(self.loaded, this)
        except (InputError, OSError):
            return None  # training goes on with the model it has
