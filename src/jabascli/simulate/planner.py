"""The per-epoch allocation choice of the trace simulator (a simple stand-in planner).

At each epoch boundary the ``jabas`` policy predicts, for every candidate
allocation, the time to finish the job from here (its best IIDP configuration at
the goodput-optimal GBS of each remaining epoch, with the statistics forecast
from those measured so far) and its cost (time x the allocation's $/hour); this
module picks one. The horizon is the rest of the job, not one epoch, because an
epoch can be far shorter than a move (CIFAR-10 on A100s: about 1 s against a
50 s restart), so a one-epoch horizon never moves. Issue #14's planner
(``autoscale/planner.py``) can replace :func:`choose_allocation` behind the same
boundary: candidates with predicted time and cost in, one candidate out.

Rule (issue #14's objective ``time``, with its margin rule):

1. a candidate other than the current allocation is charged the move: ``move_s``
   more seconds, paid at its own price;
2. with the objective ``no-dearer``, a candidate whose cost exceeds that of the
   fastest *single-type* candidate (what Pollux would run) is dropped (the
   current allocation only beyond ``margin``): other types are added only where
   they do not make the job dearer;
3. with the objective ``cost``, the cheapest candidate wins (ties to the faster),
   and the current allocation is kept unless the winner is cheaper by more than
   ``margin``; otherwise the fastest candidate sets ``t_min``; the cheapest candidate within
   ``(1 + slack) * t_min`` wins (``slack`` 0 by default: ties go to the cheaper;
   with ``no-dearer`` at least ``margin``: predictions that close are a tie the
   planner cannot resolve, so cost decides; CIFAR-10 on ``aws:2,rtx:1,azure:1``,
   where one RTX node and one V100 node are predicted 0.5% apart at the start);
4. the current allocation is kept unless the winner is faster by more than
   ``margin`` (5%, as issue #14's ``[scaling] margin``) or cheaper by more than
   ``margin`` at no loss of time, so small shifts in the predictions do not make
   the job flap.

A cost slack (``slack`` > 0) trades time for cost on the predictions; it is off
by default because early predictions are poor: on CIFAR-10 on Sia's cluster one
A100 node and two are predicted within 2% of each other at the first epoch's
GBS, and the cheaper node then runs 39% longer once the GBS grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from jabascli.simulate.configs import Allocation

DEFAULT_SLACK = 0.0
DEFAULT_MARGIN = 0.05
OBJECTIVES = ("time", "cost", "no-dearer")


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
    objective: str = "time",
) -> Candidate:
    """The candidate to run the coming epoch on (rule in the module docstring)."""
    if not candidates:
        raise ValueError("no candidate allocation")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}")

    def charged(c: Candidate) -> tuple[float, float]:
        if current is None or c.allocation == current:
            return c.time_s, c.cost
        return c.time_s + move_s, c.cost + move_s * c.price_per_s

    scored = [(*charged(c), c) for c in candidates]
    if objective == "no-dearer":
        single = [s for s in scored if len(s[2].allocation) == 1]
        if single:
            budget = min(single, key=lambda s: (s[0], s[1]))[1]
            # the current allocation keeps the margin too, so a shifting budget does not evict it
            scored = [
                s for s in scored if s[1] <= budget * ((1 + margin) if s[2].allocation == current else (1 + 1e-9))
            ]
    stay = next((s for s in scored if s[2].allocation == current), None)
    if objective == "cost":
        best = min(scored, key=lambda s: (s[1], s[0]))
        if stay is not None and not best[1] < (1 - margin) * stay[1]:
            return stay[2]
        return best[2]
    if objective == "no-dearer":
        slack = max(slack, margin)  # times within the margin are a tie the planner cannot resolve: cost decides
    t_min = min(time for time, _, _ in scored)
    fast = [s for s in scored if s[0] <= (1 + slack) * t_min]
    best = min(fast, key=lambda s: (s[1], s[0]))
    if stay is not None:
        faster = best[0] < (1 - margin) * stay[0]
        cheaper = best[1] < (1 - margin) * stay[1] and best[0] <= stay[0]
        if not (faster or cheaper):
            return stay[2]
    return best[2]
