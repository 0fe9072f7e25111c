"""What the ``jabas profile`` commands print: each profiler's result as a Rich table, or as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from jabascli.cli.common import console

if TYPE_CHECKING:
    from jabascli.profiler.comm import CommRun
    from jabascli.profiler.comp import CompRun
    from jabascli.profiler.memory import MemoryRun
    from jabascli.profiler.suite import SuiteRun
    from jabascli.profiler.summary import Summary


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def memory_json(run: MemoryRun) -> dict[str, Any]:
    return {
        "server": run.target.server.name,
        "device_type": run.target.device_type,
        "memory_bytes": run.target.memory_bytes,
        "folder": str(run.folder),
        "stopped": run.stopped,
        "results": [
            {
                "lbs": r.lbs,
                "max_num_models": r.max_num_models,
                "trials": [t.model_dump(exclude_none=True) for t in r.trials],
                "path": str(r.path) if r.path else None,
                "skipped": r.skipped,
            }
            for r in run.results
        ],
    }


def print_memory(run: MemoryRun) -> None:
    target = run.target
    table = Table(title=f"{target.server.name}: {target.describe()}, {_mib(target.memory_bytes)} per device")
    for column in ("LBS", "max VSWs", "trials", "peak at max", "file"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for r in run.results:
        peak = next((t.peak_bytes for t in r.trials if t.fits and t.num_models == r.max_num_models), None)
        trials = "on disk" if r.skipped else str(len(r.trials))
        where = str(r.path.relative_to(run.folder)) if r.path else "-"
        table.add_row(str(r.lbs), str(r.max_num_models), trials, _mib(peak), where)
    console.print(table)
    console.print(f"stopped: {run.stopped}; profiles in {run.folder}")
    if not any(r.max_num_models > 0 for r in run.results):
        console.print("[yellow]no LBS fits even one VSW: try a smaller --lbs[/yellow]")


def print_comp(run: CompRun) -> None:
    table = Table(title=f"{run.model} on {run.target.server.name}: {run.target.describe()}, ms per iteration")
    for column in ("LBS", "VSWs", "data", "fwd", "bwd", "copy", "update", "total", "samples/s", ""):
        table.add_column(column, justify="right")
    for r in run.results:
        p = r.profile
        rate = p.lbs * p.num_models / p.total_time * 1e3 if p.total_time > 0 else 0.0
        times = (p.data_time, p.fwd_time, p.bwd_time, p.copy_time, p.update_time, p.total_time)
        table.add_row(
            str(p.lbs), str(p.num_models), *(f"{t:.2f}" for t in times), f"{rate:,.0f}", "on disk" if r.skipped else ""
        )
    console.print(table)
    if run.target.slowdown != 1.0:
        console.print(f"compute phases multiplied by the emulated slowdown x{run.target.slowdown:g}")
    console.print(f"written to {run.folder}")


def print_comm(run: CommRun) -> None:
    from jabascli.profiles.formats import BUCKET_MB

    profile = run.profile
    meta = profile.meta
    title = f"{profile.kind}-node all-reduce"
    if meta is not None:
        title += f": {meta.world_size} processes ({meta.backend}), ideal at {meta.bandwidth / 1e9:g} GB/s"
    table = Table(title=title)
    for column in ("MB", "ideal ms", "measured ms", "p25-p75 ms"):
        table.add_column(column, justify="right")
    sizes_bytes: list[Any] = list(meta.sizes_bytes or []) if meta is not None else []
    for i, (ideal, measured) in enumerate(zip(profile.ideal_ms, profile.measured_ms, strict=True)):
        size = f"{sizes_bytes[i] / BUCKET_MB:g}" if i < len(sizes_bytes) else "?"
        spread = f"{run.spread[i][0]:.3f}-{run.spread[i][1]:.3f}" if run.spread else ""
        table.add_row(size, f"{ideal:.3f}", f"{measured:.3f}", spread)
    console.print(table)
    console.print(f"written to {run.path}" + (" (already there; --force measures again)" if run.skipped else ""))


def stages_json(run: SuiteRun) -> list[dict[str, Any]]:
    return [{"name": s.name, "ok": s.ok, "detail": s.detail, "seconds": round(s.seconds, 1)} for s in run.stages]


def print_suite(run: SuiteRun, took: float, config: object, ok: bool) -> None:
    """``jabas profile all``'s stages; ``ok``: no stage failed (then the next commands to run)."""
    table = Table(title="Profiles" + (f" (up to GBS {run.gbs_max})" if run.gbs_max else ""))
    for column in ("profile", "", "result", "seconds"):
        table.add_column(column)
    for s in run.stages:
        table.add_row(s.name, "ok" if s.ok else "[red]failed[/red]", escape(s.detail), f"{s.seconds:.0f}")
    console.print(table)
    console.print(f"took {took:.0f} s (expected about {run.expected_s:.0f} s)", highlight=False)
    if run.commands:
        console.print("inter-node all-reduce: run these at the same time, one on each server:")
        for command in run.commands:
            console.print(f"  {command}", highlight=False, markup=False, soft_wrap=True)
    elif ok:
        console.print(f"ready: `jabas solve -c {config} --gbs N`, or `jabas run -c {config} --gbs N`")


def summary_json(result: Summary) -> dict[str, Any]:
    return {
        "model": result.model,
        "rows": [
            {
                "lbs": r.lbs,
                "server": r.server,
                "device_type": r.device_type,
                "max_vsw": r.max_vsw,
                "points": {
                    n: {"total_ms": p.total_time, "samples_per_s": r.throughput(n)} for n, p in sorted(r.points.items())
                },
            }
            for r in result.rows
        ],
    }


def print_summary(result: Summary) -> None:
    servers = result.servers()
    table = Table(title=f"{result.model or 'profiles'}: max VSWs; best measured VSWs, ms per iteration, samples/s")
    table.add_column("LBS", justify="right")
    for server, device_type in servers:
        table.add_column(f"{server}\n{device_type}", justify="right")
    for lbs in result.lbs_values():
        cells = []
        for server, _ in servers:
            row = result.row(lbs, server)
            if row is None:
                cells.append("-")
                continue
            fit = "?" if row.max_vsw is None else str(row.max_vsw)
            best = row.best_vsw
            if best is None:
                cells.append(f"max {fit}")
            else:
                ms = row.points[best].total_time
                cells.append(f"max {fit}; {best}: {ms:,.1f} ms, {row.throughput(best):,.0f}/s")
        table.add_row(str(lbs), *cells)
    console.print(table)
