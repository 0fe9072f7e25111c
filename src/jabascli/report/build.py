"""Which plots a report has, and the page that shows them."""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jabascli.atomic import atomic_write_text
from jabascli.report import pareto, plots
from jabascli.report.sources import RunData, SimulationData, read_source


@dataclass
class Report:
    folder: Path
    index: Path
    images: list[Path] = field(default_factory=list)
    summary: list[tuple[str, str]] = field(default_factory=list)


def default_out(source: Path) -> Path:
    """``RUN_DIR/report`` for a run folder, ``<name>-report`` beside a simulation file."""
    return source / "report" if source.is_dir() else source.with_name(f"{source.stem}-report")


def write_report(source: Path, out: Path | None = None) -> Report:
    data = read_source(source)
    folder = out or default_out(source)
    folder.mkdir(parents=True, exist_ok=True)
    report = Report(folder, folder / "index.html")
    if isinstance(data, RunData):
        _run_plots(data, report)
        title = f"jabas run {data.folder.name}"
    elif data.is_trace:
        _trace_plots(data, report)
        title = f"jabas simulate --trace {data.data.get('trace', '')} ({data.path.name})"
    else:
        _simulation_plots(data, report)
        title = f"jabas simulate {data.path.name}"
    atomic_write_text(report.index, _page(title, report))
    return report


def _column(rows: list[dict[str, float]], key: str) -> list[float]:
    return [row.get(key, math.nan) for row in rows]


def setting_series(run: RunData, key: str) -> tuple[list[float], list[float]]:
    """``key`` (gbs or lr) against the step, from the exact change points of ``changes.csv`` (held to the last
    logged step); from the logged steps where a run has no ``changes.csv``."""
    if not run.changes:
        return _column(run.steps, "step"), _column(run.steps, key)
    kept: list[dict[str, float]] = []
    for row in run.changes:  # a resumed attempt appends from its checkpoint's step: it replaces what followed
        while kept and kept[-1]["step"] >= row["step"]:
            kept.pop()
        kept.append(row)
    xs, ys = _column(kept, "step"), _column(kept, key)
    last = max([*xs, *_column(run.steps, "step")])
    return [*xs, last], [*ys, ys[-1]]


def _run_plots(run: RunData, report: Report) -> None:
    steps, epochs, out = run.steps, run.epochs, report.folder
    step_x, epoch_x = _column(steps, "step"), _column(epochs, "step")
    report.images += [
        plots.lines(out / "loss.png", "Loss", "step", "loss", [
            ("train (logged steps)", step_x, _column(steps, "loss")),
            ("validation (epoch ends)", epoch_x, _column(epochs, "val_loss")),
        ]),
        plots.lines(out / "accuracy.png", "Validation accuracy", "step", "accuracy",
                    [("validation", epoch_x, _column(epochs, "val_accuracy"))], markers=True),
        plots.lines(out / "gbs.png", "Global batch size", "step", "GBS",
                    [("GBS", *setting_series(run, "gbs"))], step=True),
        plots.lines(out / "lr.png", "Learning rate", "step", "LR", [("LR", *setting_series(run, "lr"))], step=True),
        plots.lines(out / "throughput.png", "Throughput", "step", "samples/s",
                    [("samples/s", step_x, _column(steps, "samples_per_s"))]),
    ]  # fmt: skip
    if run.scaling:
        xs = [float(r.get("epoch", i)) for i, r in enumerate(run.scaling)]
        servers = sorted({name for r in run.scaling for name in (r.get("choice") or {})})
        by_server = {s: [float((r.get("choice") or {}).get(s, 0)) for r in run.scaling] for s in servers}
        report.images.append(
            plots.stacked_allocation(out / "allocation.png", "Allocation (scaling.jsonl)", "epoch", xs, by_server)
        )
    last = steps[-1] if steps else {}
    accuracy = [a for a in _column(epochs, "val_accuracy") if math.isfinite(a)]
    report.summary = [
        ("run folder", str(run.folder)),
        ("epochs finished", str(len(epochs))),
        ("last logged step", _fmt(last.get("step"), "{:.0f}")),
        ("GBS now", _fmt(last.get("gbs"), "{:.0f}")),
        ("train loss (last logged)", _fmt(last.get("loss"), "{:.4f}")),
        ("validation accuracy (last)", _fmt(accuracy[-1] if accuracy else None, "{:.4f}")),
        ("validation accuracy (best)", _fmt(max(accuracy) if accuracy else None, "{:.4f}")),
        ("samples/s (last logged)", _fmt(last.get("samples_per_s"), "{:.1f}")),
        ("training time so far", _fmt(sum(t for t in _column(epochs, "time_s") if math.isfinite(t)), "{:.1f} s")),
        ("scaling decisions", f"{len(run.scaling)} ({sum(bool(r.get('moved')) for r in run.scaling)} moves)"),
    ]
    if run.failures:
        in_place = sum(f.get("reason") == "recovery" for f in run.failures)
        lost = sum(int(f.get("steps_lost") or 0) for f in run.failures)
        times = [float(f["recovered_s"]) for f in run.failures if isinstance(f.get("recovered_s"), int | float)]
        longest = f", next iteration at most {max(times):.2f} s after" if times else ""
        text = f"{len(run.failures)} ({in_place} recovered in place, {lost} completed steps lost{longest})"
        report.summary.append(("failures", text))


def _simulation_plots(sim: SimulationData, report: Report) -> None:
    out, policies = report.folder, sim.policies

    def per_epoch(policy: dict[str, Any], key: str, cumulative: bool = False) -> tuple[list[float], list[float]]:
        xs, ys, total = [], [], 0.0
        for e in policy["epochs"]:
            value = e.get(key)
            value = math.nan if value is None else float(value)
            total += value
            xs.append(float(e["epoch"]))
            ys.append(total if cumulative else value)
        return xs, ys

    def series(key: str, scale: float = 1.0, cumulative: bool = False) -> list[tuple[str, list[float], list[float]]]:
        rows = []
        for p in policies:
            xs, ys = per_epoch(p, key, cumulative)
            rows.append((p["policy"], xs, [y / scale for y in ys]))
        return rows

    trajectory = sim.data.get("trajectory", {}).get("gbs", [])
    colours = plots.palette([p["policy"] for p in policies])
    unit, per = _time_unit(max((p.get("time_s") or 0.0) for p in policies))
    report.images += [
        plots.lines(out / "allocation.png", "GPUs per epoch", "epoch", "GPUs", series("gpus"), step=True,
                    colours=colours),
        plots.lines(out / "gbs.png", "GBS (mean per epoch)", "epoch", "GBS", series("mean_gbs")[:1], step=True,
                    colours=colours),
        plots.lines(out / "time.png", "Completion time", "epoch", unit, series("time_s", per, cumulative=True),
                    colours=colours),
        plots.lines(out / "cost.png", "Cost", "epoch", "cost", series("cost", 1.0, cumulative=True),
                    colours=colours),
        plots.lines(out / "trajectory.png", "GBS per adjustment point", "adjustment point", "GBS",
                    [("GBS", list(map(float, range(len(trajectory)))), list(map(float, trajectory)))], step=True),
    ]  # fmt: skip
    report.summary = [("simulation", str(sim.path)), ("epochs", str(sim.data.get("epochs", "?")))]
    no_cost = _no_cost_reason(sim)
    if no_cost:
        report.summary.append(("cost", no_cost))
    for p in policies:
        seconds = p.get("time_s")
        text = "cannot run" if seconds is None else (
            f"{_duration(seconds)}, {_cost(p, no_cost)}, {p.get('gpu_hours', math.nan):.1f} GPU-h, "
            f"{p.get('moves', 0)} moves"
        )  # fmt: skip
        report.summary.append((p["policy"], text))


def _trace_plots(sim: SimulationData, report: Report) -> None:
    """A trace simulation: GBS, GPUs and progress over time for every policy, the allocation per adaptive one.

    Each timeline entry holds from its ``start_s`` to the next one; the last
    until the policy's ``time_s``, where the job ends at its final ``progress``.
    """
    out, policies = report.folder, sim.policies
    colours = plots.palette([p["policy"] for p in policies])
    gpu_types = list(dict.fromkeys(t for p in policies for e in p["timeline"] for t in (e.get("gpus") or {})))
    type_colours = plots.palette(sorted(gpu_types))  # one colour per GPU type in every allocation plot

    def held(p: dict[str, Any], value: Any) -> tuple[list[float], list[float]]:
        xs = [float(e["start_s"]) / 3600 for e in p["timeline"]] + [float(p["time_s"]) / 3600]
        ys = [float(value(e)) for e in p["timeline"]]
        return xs, ys + ys[-1:]

    def gpus(entry: dict[str, Any]) -> float:
        return float(sum((entry.get("gpus") or {}).values())) if entry.get("gpus") else math.nan

    progress = []
    for p in policies:
        xs = [float(e["start_s"]) / 3600 for e in p["timeline"]] + [float(p["time_s"]) / 3600]
        ys = [float(e["progress"]) for e in p["timeline"]] + [float(p.get("progress", math.nan))]
        progress.append((p["policy"], xs, ys))
    report.images += [
        plots.lines(out / "gbs.png", "Global batch size", "hours", "GBS",
                    [(p["policy"], *held(p, lambda e: e["gbs"])) for p in policies], step=True, colours=colours),
        plots.lines(out / "gpus.png", "GPUs allocated", "hours", "GPUs",
                    [(p["policy"], *held(p, gpus)) for p in policies], step=True, colours=colours),
        plots.lines(out / "progress.png", "Statistical progress (samples at the base batch size)", "hours",
                    "progress", progress, colours=colours),
        pareto.time_cost(out / "time-cost.png", policies, colours),
    ]  # fmt: skip
    # fixed-* and ddp-all keep one allocation all along (gpus.png shows it); the adaptive policies get one plot each
    for p in policies:
        if p["policy"].startswith(("fixed-", "ddp-all")) or not p["timeline"]:
            continue
        types = list(dict.fromkeys(t for e in p["timeline"] for t in (e.get("gpus") or {})))
        xs = [float(e["start_s"]) / 3600 for e in p["timeline"]]
        by_type = {t: [float((e.get("gpus") or {}).get(t, 0)) for e in p["timeline"]] for t in types}
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", p["policy"])
        report.images.append(
            plots.stacked_allocation(out / f"allocation-{name}.png", f"Allocation: {p['policy']}", "hours",
                                     xs, by_type, end=float(p["time_s"]) / 3600, colours=type_colours)
        )  # fmt: skip
    report.summary = [
        ("simulation", str(sim.path)),
        ("trace", str(sim.data.get("trace", "?"))),
        ("cluster", ", ".join(f"{t}: {n} nodes" for t, n in (sim.data.get("cluster") or {}).items())),
        ("target metric", str(sim.data.get("target_metric") or "none: to the trace's end")),
    ]  # fmt: skip
    no_cost = _no_cost_reason(sim)
    if no_cost:
        report.summary.append(("cost", no_cost))
    for p in policies:
        report.summary.append((
            p["policy"],
            f"{_duration(p['time_s'])}, {_cost(p, no_cost)}, "
            f"{p.get('gpu_hours', math.nan):.1f} GPU-h, {p.get('moves', 0)} moves",
        ))  # fmt: skip
    comparison = sim.data.get("comparison")
    if isinstance(comparison, dict):
        report.summary.append((
            "jabas vs baselines",
            f"time {_fmt(comparison.get('time_ratio'), '{:.2f}')}x {comparison.get('fastest_baseline')}, "
            f"cost {_fmt(comparison.get('cost_ratio_vs_cheapest'), '{:.2f}')}x {comparison.get('cheapest_baseline')}",
        ))  # fmt: skip


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit a duration of up to ``seconds`` reads best in, and the seconds in one of it."""
    if seconds < 120:
        return "seconds", 1.0
    if seconds < 2 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def _duration(seconds: float) -> str:
    """``45.2 s``, ``12.5 min`` or ``3.21 h``: a short job does not print as 0.00 h."""
    unit, per = _time_unit(seconds)
    return f"{seconds / per:.{1 if per < 3600 else 2}f} {dict(seconds='s', minutes='min', hours='h')[unit]}"


def _no_cost_reason(sim: SimulationData) -> str | None:
    """Why every policy costs 0, when they all do (instead of a bare $0)."""
    if any((p.get("cost") or 0) > 0 for p in sim.policies if p.get("time_s") is not None):
        return None
    if sim.data.get("seed_prices", True):
        return (
            "not available: no server has price_per_hour, and the seed's price rule (3.06 $ x TFLOPS / 14.13 "
            "per GPU-hour) gives 0 for servers without tflops; set either in [[cluster.servers]]"
        )
    return "not available: every server's price_per_hour is 0"


def _cost(policy: dict[str, Any], no_cost: str | None) -> str:
    return "cost n/a" if no_cost else f"cost {policy.get('cost', math.nan):.2f}"


def _fmt(value: float | None, pattern: str) -> str:
    return pattern.format(value) if value is not None and math.isfinite(value) else "-"


def _page(title: str, report: Report) -> str:
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in report.summary)
    figures = "\n".join(
        f'<figure><a href="{html.escape(p.name)}"><img src="{html.escape(p.name)}" alt="{html.escape(p.stem)}"></a>'
        f"<figcaption>{html.escape(p.stem)}</figcaption></figure>"
        for p in report.images
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left}}figure{{display:inline-block;margin:1em}}
img{{max-width:700px}}</style></head>
<body><h1>{html.escape(title)}</h1>
<table>
{rows}
</table>
{figures}
</body></html>
"""
