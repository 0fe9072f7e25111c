"""Trace-driven simulation of adaptive batching and auto-scaling on real measurements.

Entry point: :func:`simulate_trace`. A trace folder (Sia/Pollux format, see
``trace.py``) gives iteration times per GPU type and the gradient statistics of
real runs; ``policies.py`` compares fixed-batch training, plain DDP over every
GPU, Pollux-style goodput adaptation on one GPU type, and jabas (IIDP over every
type, goodput-adaptive GBS, per-epoch allocation). Pure Python + numpy/scipy; no
torch. docs/simulation.md states every assumption.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.simulate.cluster import parse_cluster, prices_for
from jabascli.simulate.loop import PolicyResult
from jabascli.simulate.policies import BASELINES, POLICIES, Simulation, run_policies
from jabascli.simulate.trace import load_trace

__all__ = ["POLICIES", "TraceResult", "simulate_trace"]


@dataclass
class TraceResult:
    """The policies' results on one trace and cluster."""

    trace: str
    cluster: dict[str, int]
    prices: dict[str, float]
    target_metric: float | None
    policies: list[PolicyResult]
    objective: str = "time"

    def get(self, name: str) -> PolicyResult | None:
        return next((p for p in self.policies if p.policy == name), None)

    def comparison(self) -> dict[str, Any] | None:
        """``jabas`` against the best baseline: the soonest and the cheapest of fixed-*, ddp-all, pollux."""
        jabas = self.get("jabas")
        baselines = [p for p in self.policies if p.policy.startswith(BASELINES)]
        if jabas is None or not baselines:
            return None
        fastest = min(baselines, key=lambda p: p.time_s)
        cheapest = min(baselines, key=lambda p: p.cost)
        return {
            "fastest_baseline": fastest.policy,
            "cheapest_baseline": cheapest.policy,
            "time_ratio": jabas.time_s / fastest.time_s,
            "cost_ratio_vs_fastest": _ratio(jabas.cost, fastest.cost),
            "cost_ratio_vs_cheapest": _ratio(jabas.cost, cheapest.cost),
        }

    def dominating(self, name: str = "jabas") -> list[str]:
        """The baselines both sooner and cheaper than policy ``name`` (the Pareto check; empty when none)."""
        policy = self.get(name)
        if policy is None:
            return []
        return [
            p.policy
            for p in self.policies
            if p.policy.startswith(BASELINES) and p.time_s < policy.time_s and p.cost < policy.cost
        ]

    def cost_at_no_greater_time(self, name: str = "jabas") -> float | None:
        """Policy ``name``'s cost over the cheapest baseline's among those not sooner than it (None: none)."""
        policy = self.get(name)
        if policy is None:
            return None
        slower = [p.cost for p in self.policies if p.policy.startswith(BASELINES) and p.time_s >= policy.time_s]
        return _ratio(policy.cost, min(slower)) if slower else None

    def relative(self) -> dict[str, tuple[float, float | None]]:
        """Each policy's time over the fastest baseline's and cost over the cheapest baseline's.

        Time over the soonest baseline (issue #23: ``jabas`` at most 1.00) and cost over the cheapest,
        for every policy, so a table can show where each stands; empty without a baseline.
        """
        baselines = [p for p in self.policies if p.policy.startswith(BASELINES)]
        if not baselines:
            return {}
        fastest = min(p.time_s for p in baselines)
        cheapest = min(p.cost for p in baselines)
        return {p.policy: (p.time_s / fastest, _ratio(p.cost, cheapest)) for p in self.policies}

    def to_json(self, timeline: bool = True) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "cluster": self.cluster,
            "prices": self.prices,
            "target_metric": self.target_metric,
            "objective": self.objective,
            "policies": [p.to_json(timeline) for p in self.policies],
            "comparison": self.comparison(),
            "dominated_by": self.dominating() if self.get("jabas") is not None else None,
        }


def _ratio(a: float, b: float) -> float | None:
    """``a / b``, or None where a price of 0 (``--prices aws=0``) makes the baseline free."""
    return a / b if b > 0 else None


def simulate_trace(
    trace_dir: Path | str,
    cluster_spec: str | Mapping[str, int],
    policies: Sequence[str] = POLICIES,
    prices: Mapping[str, float] | None = None,
    target_metric: float | None = None,
    objective: str = "time",
) -> TraceResult:
    """Simulate one traced job on a cluster under each policy.

    ``cluster_spec``: ``"aws:6,dgx-ext:2,rtx:3"`` or ``{"aws": 6, ...}`` (nodes per
    GPU type); ``prices``: $/GPU-hour overrides; ``target_metric``: end the job when
    the traced validation metric reaches it, and plan to it (default: at the trace's end);
    ``objective``: jabas's planner objective, ``time``, ``cost`` or ``no-dearer`` (``planner.py``).
    Raises :class:`~jabascli.errors.InputError` on a bad folder, cluster, policy or target.
    """
    cluster = parse_cluster(cluster_spec) if isinstance(cluster_spec, str) else dict(cluster_spec)
    trace = load_trace(trace_dir, list(cluster))
    price_table = prices_for(list(cluster), prices)
    sim = Simulation(trace, cluster, price_table, target_metric, objective=objective)
    results = run_policies(sim, list(policies))
    return TraceResult(trace.name, cluster, price_table, target_metric, results, objective)
