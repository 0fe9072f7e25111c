"""The allocation planner: which servers to run the next epoch on.

For a forecast of the next epoch as segments ``(g_k, n_k)`` (``n_k``
iterations at GBS ``g_k``, :mod:`jabascli.autoscale.trajectory`) and an
allocation ``A`` (units per server type, :mod:`jabascli.autoscale.allocation`):

    time(A) = sum_k n_k * t(A, g_k)  (+ D if A is not the current allocation)
    cost(A) = time(A) / 3600 * price_per_hour(A)

where ``t`` is the cost model's iteration time
(:class:`~jabascli.autoscale.costmodel.IterationCostModel`, the solver's
optimum for the profile-based one) and ``D`` the move downtime
(``[scaling] move_downtime_s`` until measured): a move stops the job,
checkpoints and restarts it. The objectives (``[scaling] objective``):

* ``time``: the least ``time(A)`` with ``cost(A) <= budget_per_epoch`` if a budget is set;
* ``cost``: the least ``cost(A)`` with ``time(A) <= deadline_per_epoch_s`` if a deadline is set;

both constraints apply whenever they are set. Ties go to fewer GPUs, then to
the smaller choice tuple. With a ``tie`` band, values within ``(1 + tie)`` of
the best are a tie the predictions cannot resolve, and the other measure
decides among them (the least cost for ``time``, the least time for ``cost``).
The margin rule: the job moves from its current
allocation ``C`` to the best ``B`` only if ``value(B) < (1 - margin) * value(C)``
(``B`` charged ``D``, ``C`` not), or if ``C`` breaks a constraint or cannot
train at a forecast GBS; so noise in a flat trajectory does not make it flap.

Search. When the allocations number at most ``exhaustive_limit`` all are
candidates; beyond, the candidates are the current allocation, every unit,
each type alone, the prefixes of orders of the types at sizes 1, 2, 4 ...
units (every order up to ``FEW_TYPES`` types, else two: fastest first, and
cheapest per sample first), and then, from the best
so far, steps of one server (then of one unit) on each type, alone or traded
against as many units of another type, while they improve (a local search: a heuristic, with
no guarantee of the optimum; tests compare it with the exhaustive search on
small clusters). Either way the
candidates are ranked by the cost model's ``lower_bound`` when it has one,
and solved exactly in that order until the bound exceeds the best value found
(branch and bound), so most are never solved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any, Literal, Protocol

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import IterationCostModel
from jabascli.autoscale.trajectory import Segment, merge
from jabascli.errors import InputError
from jabascli.solver.cluster import allocation_key

ObjectiveKind = Literal["time", "cost"]
EXHAUSTIVE_LIMIT = 4096
FEW_TYPES = 4
"""Up to this many server types the local search seeds the prefixes of every order of the types (4! = 24)."""


class Space(Protocol):
    """The allocations the planner chooses among: an :class:`AllocationSpace`, or a trace simulator's.

    Beyond ``exhaustive_limit`` choices the local search needs an :class:`AllocationSpace`.
    """

    def count(self) -> int: ...
    def __iter__(self) -> Iterator[Choice]: ...
    def check(self, choice: Choice) -> Choice: ...
    def gpus(self, choice: Choice) -> int: ...
    def price_per_hour(self, choice: Choice) -> float: ...


@dataclass(frozen=True)
class Objective:
    """What the planner minimises, its constraints, and when it moves (see the module doc)."""

    kind: ObjectiveKind = "time"
    budget_per_epoch: float | None = None
    deadline_per_epoch_s: float | None = None
    margin: float = 0.05
    move_downtime_s: float = 60.0
    tie: float = 0.0
    """Values within ``(1 + tie)`` of the best are a tie: the other measure decides (module doc)."""

    @classmethod
    def from_config(cls, scaling: Any) -> Objective:
        """From a ``[scaling]`` section (``jabascli.config.models.ScalingConfig``)."""
        return cls(
            scaling.objective,
            scaling.budget_per_epoch,
            scaling.deadline_per_epoch_s,
            scaling.margin,
            scaling.move_downtime_s,
        )


@dataclass(frozen=True)
class Estimate:
    """The next epoch on one allocation, as the planner predicts it."""

    choice: Choice
    gpus: int
    time_s: float
    """Including the move downtime when ``move``."""
    cost: float
    move: bool

    def value(self, objective: Objective) -> float:
        return self.time_s if objective.kind == "time" else self.cost

    def other(self, objective: Objective) -> float:
        """The measure the objective does not minimise: what decides a tie."""
        return self.cost if objective.kind == "time" else self.time_s

    def meets(self, objective: Objective) -> bool:
        """Finite, within the budget and the deadline."""
        if not math.isfinite(self.time_s):
            return False
        if objective.budget_per_epoch is not None and self.cost > objective.budget_per_epoch:
            return False
        return objective.deadline_per_epoch_s is None or self.time_s <= objective.deadline_per_epoch_s

    def key(self, objective: Objective) -> tuple[float, int, Choice]:
        # The same rule as `jabas run --servers auto`: the best value, ties to fewer GPUs.
        return (*allocation_key(self.value(objective), self.gpus), self.choice)


@dataclass
class Decision:
    """What the planner chose and why; ``to_dict`` is one line of ``scaling.jsonl``."""

    choice: Choice
    current: Choice | None
    reason: str
    chosen: Estimate
    current_estimate: Estimate | None
    candidates: list[Estimate] = field(default_factory=list)
    """Every candidate solved exactly, best first."""
    considered: int = 0
    """Candidates ranked (solved or ruled out by their bound)."""

    @property
    def moved(self) -> bool:
        return self.current is not None and self.choice != self.current

    def to_dict(self, space: AllocationSpace, *, top: int = 5) -> dict[str, Any]:
        def row(e: Estimate) -> dict[str, Any]:
            return {"servers": space.used(e.choice), "gpus": e.gpus, "time_s": e.time_s, "cost": e.cost}

        return {
            "choice": space.used(self.choice),
            "current": space.used(self.current) if self.current is not None else None,
            "moved": self.moved,
            "reason": self.reason,
            "predicted": row(self.chosen),
            "candidates": [row(e) for e in self.candidates[:top]],
            "considered": self.considered,
        }


def epoch_time(cost_model: IterationCostModel, choice: Choice, segments: Iterable[Segment]) -> float:
    return sum(s.iterations * cost_model.iteration_time(choice, s.gbs) for s in segments)


class Planner:
    """Plans on one cluster with one cost model; reusable epoch after epoch."""

    def __init__(
        self,
        space: Space,
        cost_model: IterationCostModel,
        objective: Objective | None = None,
        *,
        exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    ) -> None:
        self.space = space
        self.cost_model = cost_model
        self.objective = objective or Objective()
        self.exhaustive_limit = exhaustive_limit
        if not 0 <= self.objective.margin < 1:
            raise InputError.at(None, "scaling.margin", f"expected 0 <= margin < 1, got {self.objective.margin}")

    # Estimates ----------------------------------------------------------------------

    def estimate(self, choice: Choice, segments: Sequence[Segment], current: Choice | None) -> Estimate:
        move = current is not None and choice != current
        time_s = epoch_time(self.cost_model, choice, segments)
        time_s += self.objective.move_downtime_s if move else 0.0
        cost = time_s / 3600 * self.space.price_per_hour(choice) if math.isfinite(time_s) else math.inf
        return Estimate(choice, self.space.gpus(choice), time_s, cost, move)

    def bound(self, choice: Choice, segments: Sequence[Segment], current: Choice | None) -> Estimate:
        """An :class:`Estimate` from the cost model's lower bounds (the estimate itself without them)."""
        lower = getattr(self.cost_model, "lower_bound", None)
        if lower is None:
            return self.estimate(choice, segments, current)
        time_s = sum(s.iterations * lower(choice, s.gbs) for s in segments)
        time_s += self.objective.move_downtime_s if current is not None and choice != current else 0.0
        cost = time_s / 3600 * self.space.price_per_hour(choice) if math.isfinite(time_s) else math.inf
        return Estimate(choice, self.space.gpus(choice), time_s, cost, current is not None and choice != current)

    # The decision ----------------------------------------------------------------------

    def plan(self, segments: Sequence[Segment], current: Choice | None = None) -> Decision:
        """The allocation for an epoch of ``segments``, starting from ``current`` (None: not running yet)."""
        if not segments:
            raise InputError.at(None, "forecast", "is empty: nothing to plan for")
        segments = merge(segments)
        if current is not None:
            current = self.space.check(current)
        objective = self.objective
        solved: dict[Choice, Estimate] = {}
        considered: set[Choice] = set()

        def best_of(choices: Iterable[Choice], incumbent: Estimate | None) -> Estimate | None:
            bounds = []
            for c in choices:
                if c in solved or c in considered:
                    continue
                considered.add(c)
                b = self.bound(c, segments, current)
                if b.meets(objective):
                    bounds.append(b)
            bounds.sort(key=lambda b: b.key(objective))
            for b in bounds:
                if incumbent is not None and b.value(objective) > (1 + objective.tie) * incumbent.value(objective):
                    break
                e = solved[b.choice] = self.estimate(b.choice, segments, current)
                if e.meets(objective) and (incumbent is None or e.key(objective) < incumbent.key(objective)):
                    incumbent = e
            return incumbent

        current_estimate = None
        best: Estimate | None = None
        if current is not None:
            current_estimate = solved[current] = self.estimate(current, segments, current)
            considered.add(current)
            best = current_estimate if current_estimate.meets(objective) else None
        if self.space.count() <= self.exhaustive_limit:
            best = best_of(self.space, best)
        else:
            best = self._local_search(segments, best_of, best)
        if best is None:
            raise InputError.at(None, "scaling", self._why_none(segments, current))
        best = self._tie_break(best, solved.values())
        candidates = sorted(solved.values(), key=lambda e: e.key(objective))
        choice, reason = self._margin_rule(best, current_estimate)
        chosen = solved[choice]
        return Decision(choice, current, reason, chosen, current_estimate, candidates, len(considered))

    def _tie_break(self, best: Estimate, solved: Iterable[Estimate]) -> Estimate:
        """Among the estimates within ``(1 + tie)`` of the best value, the one of least other measure."""
        objective = self.objective
        if objective.tie <= 0:
            return best
        top = (1 + objective.tie) * best.value(objective)
        tied = [e for e in solved if e.meets(objective) and e.value(objective) <= top]
        return min(tied, key=lambda e: (e.other(objective), e.key(objective)), default=best)

    def _margin_rule(self, best: Estimate, current: Estimate | None) -> tuple[Choice, str]:
        objective = self.objective
        what = "time" if objective.kind == "time" else "cost"
        if current is None:
            return best.choice, f"first allocation: the least predicted {what}"
        if not current.meets(objective):
            why = "cannot train at a forecast GBS" if not math.isfinite(current.time_s) else "breaks a constraint"
            return best.choice, f"the current allocation {why}"
        if best.choice == current.choice:
            return current.choice, f"the current allocation has the least predicted {what}"
        gain = 1 - best.value(objective) / current.value(objective) if current.value(objective) > 0 else 0.0
        if gain > objective.margin:
            return (
                best.choice,
                f"predicted {what} {gain:.1%} lower, move downtime included (margin {objective.margin:.0%})",
            )
        return current.choice, f"best alternative only {gain:.1%} better, below the margin {objective.margin:.0%}"

    def _why_none(self, segments: Sequence[Segment], current: Choice | None) -> str:
        o = self.objective
        limits = []
        if o.budget_per_epoch is not None:
            limits.append(f"budget_per_epoch {o.budget_per_epoch:g}")
        if o.deadline_per_epoch_s is not None:
            limits.append(f"deadline_per_epoch_s {o.deadline_per_epoch_s:g}")
        gbs = sorted({s.gbs for s in segments})
        if limits:
            return f"no allocation meets {' and '.join(limits)} for the forecast GBS {gbs[0]}..{gbs[-1]}"
        return f"no allocation can train at the forecast GBS {gbs[0]}..{gbs[-1]}"

    # Search on large clusters ---------------------------------------------------------

    def _local_search(self, segments: Sequence[Segment], best_of: Any, best: Estimate | None) -> Estimate | None:
        space = self.space
        if not isinstance(space, AllocationSpace):
            raise TypeError(f"the local search needs an AllocationSpace, not {type(space).__name__}")
        types = space.types
        zero = (0,) * len(types)

        def only(t: int, units: int) -> Choice:
            return tuple(units if i == t else 0 for i in range(len(types)))

        # Rank types by one unit's time per sample at the epoch's mean GBS (and per dollar).
        mean_gbs = sum(s.gbs * s.iterations for s in segments) / sum(s.iterations for s in segments)
        probe = [Segment(max(1, round(mean_gbs)), 1)]
        per_sample = [self.bound(only(t, 1), probe, None).time_s for t in range(len(types))]
        fastest = sorted(range(len(types)), key=lambda t: per_sample[t])
        cheapest = sorted(range(len(types)), key=lambda t: per_sample[t] * types[t].gpu_hour_price)
        seeds = {space.everything(), *(only(t, types[t].units) for t in range(len(types)))}
        # With few types every order: two types ranked alike (the same device on other links or at another
        # price) must not keep the pair of them out of the seeds (hypothesis found 9% lost that way).
        orders = permutations(range(len(types))) if len(types) <= FEW_TYPES else (fastest, cheapest)
        for order in orders:
            total = sum(types[t].units for t in order)
            size = 1
            while size <= total:
                left, counts = size, list(zero)
                for t in order:
                    counts[t] = min(left, types[t].units)
                    left -= counts[t]
                seeds.add(tuple(counts))
                size *= 2
        best = best_of(sorted(seeds), best)
        # Coarse to fine: whole servers first, then single units.
        for step_of in (lambda kind: kind.units_per_server, lambda kind: 1):
            while best is not None:
                around = set()
                for t, kind in enumerate(types):
                    step = step_of(kind)
                    for sign in (-1, 1):
                        c = list(best.choice)
                        c[t] = min(max(c[t] + sign * step, 0), kind.units)
                        around.add(tuple(c))
                        for u in range(len(types)):  # and as many units given back by another type
                            if u != t:
                                d = list(c)
                                d[u] = min(max(d[u] - sign * step, 0), types[u].units)
                                around.add(tuple(d))
                improved = best_of(sorted(c for c in around if any(c)), best)
                if improved is None or improved.choice == best.choice:
                    break
                best = improved
        return best
