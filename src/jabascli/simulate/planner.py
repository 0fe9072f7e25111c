"""The per-epoch allocation choice of the trace simulator (a simple stand-in planner).

At each epoch boundary the ``jabas`` and ``oracle`` policies predict, for every
candidate allocation, the time to finish the job from here (its best IIDP
configuration at the goodput-optimal GBS, with the statistics as they know them
now) and its cost (time x the allocation's $/hour); this module picks one. The
horizon is the rest of the job, not one epoch, because an epoch can be far
shorter than a move (CIFAR-10 on A100s: about 1 s against a 50 s restart), so a
one-epoch horizon never moves. Issue #14's planner (``autoscale/planner.py``) can replace
:func:`choose_allocation` behind the same boundary: candidates with predicted
time and cost in, one candidate out.

Rule (objective "time with a cost slack"):

1. a candidate other than the current allocation is charged the move: ``move_s``
   more seconds, paid at its own price;
2. the fastest candidate sets ``t_min``; every candidate within
   ``(1 + slack) * t_min`` is *fast enough*;
3. the cheapest fast-enough candidate wins (ties: the faster), except that
4. the current allocation is kept while it is fast enough and the winner is not
   cheaper by more than ``margin`` (5%, as issue #14's ``[scaling] margin``).

So a dearer allocation is taken only when it is more than ``slack`` faster than
every cheaper one, a move only when it pays for its own downtime, and small
shifts in the predictions do not make the job flap.
"""

from __future__ import annotations

from dataclasses import dataclass

from jabascli.simulate.configs import Allocation

DEFAULT_SLACK = 0.05
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Candidate:
    """A candidate allocation with its predicted time (s) and cost ($) to finish the job."""

    allocation: Allocation
    time_s: float
    cost: float
    price_per_s: float


def choose_allocation(
    candidates: list[Candidate],
    current: Allocation | None,
    move_s: float,
    slack: float = DEFAULT_SLACK,
    margin: float = DEFAULT_MARGIN,
) -> Candidate:
    """The candidate to run the coming epoch on (rule in the module docstring)."""
    if not candidates:
        raise ValueError("no candidate allocation")

    def charged(c: Candidate) -> tuple[float, float]:
        if current is None or c.allocation == current:
            return c.time_s, c.cost
        return c.time_s + move_s, c.cost + move_s * c.price_per_s

    scored = [(charged(c), c) for c in candidates]
    t_min = min(time for (time, _), _ in scored)
    fast = [(cost, time, c) for (time, cost), c in scored if time <= (1 + slack) * t_min]
    best_cost, _, best = min(fast, key=lambda x: (x[0], x[1]))
    stay = next((x for x in fast if x[2].allocation == current), None)
    if stay is not None and stay[0] <= (1 + margin) * best_cost:
        return stay[2]
    return best
