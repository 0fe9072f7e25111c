"""What the planner asks of a performance model: an allocation's iteration time at a GBS.

:class:`IterationCostModel` is the interface: ``iteration_time(choice, gbs)``
in seconds (``inf`` when the allocation cannot train at that GBS), and
optionally ``lower_bound(choice, gbs)``, a cheap value never above it that the
planner sorts candidates by. :class:`SolverCostModel` answers from the
profiles through the exact solver; a trace-driven simulator can plug in its
own model instead.

A GBS that an allocation cannot split exactly (no LBS divides it into whole
units) is charged at the per-sample time of the nearest GBS it can split
(nearest by ratio, ties to the larger): ``t(g) = t(g') * g / g'``. The adaptive
batching policy moves in steps of its own, so this charges the neighbouring
reachable rate rather than ruling the allocation out. A GBS below the smallest
the allocation can split (every GPU needs one worker) is ``inf``.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.errors import InputError
from jabascli.perfmodel import PerformanceModel
from jabascli.solver import Solver


@runtime_checkable
class IterationCostModel(Protocol):
    def iteration_time(self, choice: Choice, gbs: int) -> float:
        """Seconds per iteration of allocation ``choice`` at global batch size ``gbs``; inf if impossible."""
        ...


class SolverCostModel:
    """Iteration times from the profiles: the solver's optimum on the allocation, cached."""

    def __init__(
        self,
        model: PerformanceModel,
        space: AllocationSpace,
        weight_sync: str = "recommend",
        *,
        warm_gbs: int | None = None,
    ) -> None:
        """``warm_gbs``: size each allocation's solver tables for GBS up to it at once (a simulation
        of a growing GBS would otherwise rebuild them a little larger at every new GBS)."""
        self.model = model
        self.space = space
        self.weight_sync = weight_sync
        self.warm_gbs = warm_gbs
        self._solvers: dict[Choice, Solver] = {}
        self._times: dict[tuple[Choice, int], float] = {}
        self._bounds: dict[tuple[Choice, int], float] = {}

    def solver(self, choice: Choice) -> Solver:
        solver = self._solvers.get(choice)
        if solver is None:
            solver = Solver(self.model, self.space.specs(choice), self.space.unit, self.weight_sync)
            self._solvers[choice] = solver
            if self.warm_gbs is not None:
                step_of = {
                    lbs * self.space.unit for s in solver.servers for lbs in self.model.lbs_values(s.profile_server)
                }
                for step in step_of:
                    top = self.warm_gbs // step * step
                    if top and solver.reachable(top):
                        solver.lower_bound(top)
                        self._exact(choice, top)
        return solver

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        key = (choice, gbs)
        if key not in self._times:
            self._times[key] = math.inf
            for neighbour in self.neighbours(choice, gbs):
                t = self._exact(choice, neighbour)
                if math.isfinite(t):
                    self._times[key] = t * gbs / neighbour
                    break
        return self._times[key]

    def lower_bound(self, choice: Choice, gbs: int) -> float:
        key = (choice, gbs)
        if key in self._times:
            return self._times[key]
        if key not in self._bounds:
            # The exact time is charged at one of the neighbours: the least of their bounds is a bound.
            solver = self.solver(choice)
            bounds = [solver.lower_bound(g) * gbs / g for g in self.neighbours(choice, gbs)]
            self._bounds[key] = min(bounds, default=math.inf)
        return self._bounds[key]

    def _exact(self, choice: Choice, gbs: int) -> float:
        try:
            return self.solver(choice).solve(gbs).iteration_time_s
        except InputError:
            return math.inf

    def neighbours(self, choice: Choice, gbs: int) -> list[int]:
        """``gbs`` itself if reachable, else the reachable GBS around it, nearest first (by ratio)."""
        solver = self.solver(choice)
        if solver.reachable(gbs):
            return [gbs]
        unit, gpus = self.space.unit, self.space.gpus(choice)
        lbs_values = set.intersection(*(set(self.model.lbs_values(s.profile_server)) for s in solver.servers))
        if not lbs_values or gbs < min(lbs_values) * gpus:
            return []
        around = set()
        for lbs in lbs_values:
            step = lbs * unit
            below = gbs // step * step
            for g in (below, below + step):
                if g >= lbs * gpus:
                    around.add(g)
        return sorted(around, key=lambda g: (abs(math.log(g / gbs)), -g))
