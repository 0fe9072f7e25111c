"""The simulation loop: one job, epoch by epoch, under one policy.

The trace's statistics change only at epoch boundaries (one row per epoch), so
within an epoch a configuration's progress rate is constant and the loop steps a
whole epoch at once, exactly:

    rate_k  = gain_k(gbs) / iter_s                 (progress per second)
    time_k  = epoch_progress(k) / rate_k
    iters_k = time_k / iter_s

with ``gain_k`` the true progress per iteration of epoch ``k`` at the GBS run
(``E_k(gbs) * gbs / M0`` times the trace's credit, ``progress.py``).
At each boundary the policy chooses the allocation and configuration of the next
epoch; a change of allocation is a move (checkpoint-restart: the trace's restart
cost in seconds, paid on the new allocation); a change of GBS on the same
allocation is made in place and costs nothing. The job ends after the trace's
last epoch, or at the end of the first epoch whose best metric reaches the
target. Cost is GPU-seconds x the type's price; GPU-hours count allocated GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jabascli.simulate.configs import Allocation, Config, describe
from jabascli.simulate.progress import Statistics

# decide(epoch, current allocation, current GBS) -> (allocation, configuration) for the epoch
Decide = Callable[[int, Allocation | None, float | None], tuple[Allocation, Config]]


@dataclass
class PolicyResult:
    policy: str
    time_s: float = 0.0
    cost: float = 0.0
    gpu_hours: float = 0.0
    moves: int = 0
    iterations: float = 0.0
    epochs: int = 0
    target_reached: bool | None = None
    final_metric: float = 0.0
    progress: float = 0.0  # statistical progress at the end (the trace's end, or where the target was met)
    details: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self, timeline: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "time_s": round(self.time_s, 3),
            "cost": round(self.cost, 4),
            "gpu_hours": round(self.gpu_hours, 4),
            "moves": self.moves,
            "iterations": round(self.iterations, 1),
            "epochs": self.epochs,
            "target_reached": self.target_reached,
            "final_metric": self.final_metric,
            "progress": round(self.progress, 3),
            **self.details,
        }
        if timeline:
            out["timeline"] = self.timeline
        return out


def run_policy(
    name: str,
    decide: Decide,
    stats: Statistics,
    prices: dict[str, float],
    per_node: dict[str, int],
    restart_s: float,
    target_metric: float | None = None,
) -> PolicyResult:
    """Simulate one job under ``decide`` (the loop in the module docstring)."""
    result = PolicyResult(policy=name)
    allocation: Allocation | None = None
    gbs: float | None = None
    progress = 0.0
    for epoch in range(stats.epochs):
        new_allocation, config = decide(epoch, allocation, gbs)
        price_s = sum(prices[t] * g for t, g in new_allocation) / 3600.0
        gpus = sum(g for _, g in new_allocation)
        if allocation is not None and new_allocation != allocation:
            result.moves += 1
            result.time_s += restart_s
            result.cost += restart_s * price_s
            result.gpu_hours += restart_s * gpus / 3600.0
        allocation, gbs = new_allocation, config.gbs
        rate = float(stats.gain(config.gbs, epoch)) / config.iter_s
        seconds = stats.epoch_progress(epoch) / rate
        result.timeline.append(
            {
                "epoch": epoch,
                "start_s": round(result.time_s, 3),
                "progress": round(progress, 3),
                "gbs": round(config.gbs, 3),
                "lbs": round(config.lbs, 3),
                "iter_s": round(config.iter_s, 6),
                "allocation": describe(allocation, per_node),
                "gpus": dict(allocation),
                "micro_steps": config.micro_steps,
            }
        )
        result.time_s += seconds
        result.cost += seconds * price_s
        result.gpu_hours += seconds * gpus / 3600.0
        result.iterations += seconds / config.iter_s
        result.epochs = epoch + 1
        progress = float(stats.boundaries[epoch])
        result.progress = progress
        result.final_metric = stats.best_metric(config.gbs, epoch)
        if target_metric is not None and stats.reached(result.final_metric, target_metric):
            break
    if target_metric is not None:
        result.target_reached = stats.reached(result.final_metric, target_metric)
    return result
