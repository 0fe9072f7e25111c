"""One PNG per figure, drawn with matplotlib's Agg backend (no display needed) and written atomically."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jabascli.atomic import atomic_write_bytes


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(x) and math.isfinite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    *,
    step: bool = False,
    markers: bool = False,
) -> Path:
    """One line per ``(label, xs, ys)``; NaN points left out; an empty series still gives a titled plot."""
    fig, ax = _figure(title, xlabel, ylabel)
    if len(series) > 10:  # the default cycle repeats after 10: two policies would share a colour
        import matplotlib

        ax.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)
    drawn = False
    for label, xs, ys in series:
        x, y = _finite(xs, ys)
        if not x:
            continue
        drawn = True
        if step:
            ax.step(x, y, where="post", label=label)
        else:
            few = len(x) < 3  # a line through one or two points is hard to see
            ax.plot(x, y, marker="o" if markers or few else None, markersize=4 if few else 3, label=label)
    if not drawn:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
    elif len(series) > 1:
        ax.legend(fontsize="small")
    return _save(fig, path)


def stacked_allocation(
    path: Path,
    title: str,
    xlabel: str,
    xs: Sequence[float],
    by_server: dict[str, list[float]],
    end: float | None = None,
) -> Path:
    """GPUs used per server over time, stacked, held until the next decision (the last one until ``end``)."""
    fig, ax = _figure(title, xlabel, "GPUs")
    if xs:
        x = [*xs, xs[-1] + 1 if end is None else end]
        ys = [[*values, values[-1]] for values in by_server.values()]
        ax.stackplot(x, ys, labels=list(by_server), step="post")
        ax.legend(fontsize="small", loc="upper left")
    else:
        ax.text(0.5, 0.5, "no decisions yet", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)
