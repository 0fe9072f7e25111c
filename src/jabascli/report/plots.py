"""One PNG per figure, drawn with matplotlib's Agg backend (no display needed) and written atomically.

Colours: a report gives every policy and every GPU type one colour for all its
figures (:func:`palette`), so "rtx" is the same colour in each allocation plot.
Series that coincide (two policies that made the same choices) are drawn with
their own line style and marker on top of each other, and the legend says
which they equal, so that neither hides the other.
"""

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


STYLES = [("-", None), ("--", "o"), (":", "s"), ("-.", "^"), ((0, (1, 3)), "v"), ((0, (5, 2, 1, 2)), "D")]
"""Line style and marker of the first, second ... series that coincide with an earlier one."""


def palette(names: Sequence[str]) -> dict[str, Any]:
    """One colour per name, in the order given (tab10, then tab20 for more than ten)."""
    import matplotlib

    colours = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"].colors
    return {name: colours[i % len(colours)] for i, name in enumerate(dict.fromkeys(names))}


def coincident(series: Sequence[tuple[str, Sequence[float], Sequence[float]]]) -> list[tuple[str, Any]]:
    """Each series' legend label and (line style, marker): one that repeats an earlier series point for point
    gets the next style and ``"<label> (= <first>)"``."""
    seen: dict[tuple[tuple[float, ...], tuple[float, ...]], list[str]] = {}
    shown = []
    for label, xs, ys in series:
        same = seen.setdefault(tuple(map(tuple, _finite(xs, ys))), [])  # type: ignore[arg-type]
        shown.append((f"{label} (= {same[0]})" if same else label, STYLES[len(same) % len(STYLES)]))
        same.append(label)
    return shown


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    *,
    step: bool = False,
    markers: bool = False,
    colours: dict[str, Any] | None = None,
) -> Path:
    """One line per ``(label, xs, ys)``; NaN points left out; an empty series still gives a titled plot.

    ``colours``: label -> colour (default: one each, in the order given).
    """
    fig, ax = _figure(title, xlabel, ylabel)
    colours = colours or palette([label for label, _, _ in series])
    drawn = False
    for (label, xs, ys), (shown, (linestyle, marker)) in zip(series, coincident(series), strict=True):
        x, y = _finite(xs, ys)
        if not x:
            continue
        drawn = True
        style = {"color": colours.get(label), "linestyle": linestyle, "label": shown}
        if step:
            ax.step(x, y, where="post", marker=marker, markevery=max(1, len(x) // 12), **style)
        else:
            few = len(x) < 3  # a line through one or two points is hard to see
            shape = marker or ("o" if markers or few else None)
            ax.plot(x, y, marker=shape, markersize=4 if few or marker else 3, **style)
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
    colours: dict[str, Any] | None = None,
) -> Path:
    """GPUs used per server (or GPU type) over time, stacked, held until the next decision (the last one until
    ``end``); ``colours``: name -> colour, the same in every plot of a report."""
    fig, ax = _figure(title, xlabel, "GPUs")
    if xs:
        x = [*xs, xs[-1] + 1 if end is None else end]
        ys = [[*values, values[-1]] for values in by_server.values()]
        colours = colours or palette(list(by_server))
        ax.stackplot(x, ys, labels=list(by_server), step="post", colors=[colours[n] for n in by_server])
        ax.legend(fontsize="small", loc="upper left")
    else:
        ax.text(0.5, 0.5, "no decisions yet", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)
