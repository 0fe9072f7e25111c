"""The time x cost plane of a trace simulation: each policy one point, the Pareto front marked.

A point ``(hours, $)`` per policy; a policy is on the front when no other is both
sooner and cheaper. ``jabas`` must not have a baseline (``fixed-*``, ``ddp-all``,
``pollux``) below and left of it (issue #23's Pareto check).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jabascli.report import plots


def front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The names whose point no other beats in both time and cost."""
    return [
        name
        for name, (t, c) in points.items()
        if not any(t2 < t and c2 < c for other, (t2, c2) in points.items() if other != name)
    ]


def time_cost(path: Path, policies: Sequence[Mapping[str, Any]], colours: Mapping[str, Any] | None = None) -> Path:
    """Draw each policy's completion time (hours) against its cost ($), the Pareto front joined by a line;
    ``colours``: each policy's colour in the report's other figures (:func:`plots.palette`)."""
    points = {str(p["policy"]): (float(p["time_s"]) / 3600, float(p.get("cost", float("nan")))) for p in policies}
    fig, ax = plots._figure("Time and cost per policy (lower left is better)", "hours", "cost ($)")
    on_front = sorted((points[n] for n in front(points)), key=lambda tc: tc[0])
    if len(on_front) > 1:
        ax.plot(*zip(*on_front, strict=True), color="0.6", linestyle="--", linewidth=1, label="Pareto front")
    for name, (t, c) in points.items():
        marker = "*" if name.startswith("jabas") else ("D" if name == "oracle" else "o")
        colour = (colours or {}).get(name)
        ax.scatter([t], [c], marker=marker, s=90 if marker == "*" else 40, label=name, zorder=3, color=colour)
    ax.legend(fontsize=7, ncol=2)
    return plots._save(fig, path)
