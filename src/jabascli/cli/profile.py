"""``jabas profile``: measure memory, computation, buckets and communication."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from jabascli.cli.common import (
    AcceptNewHostKeysOption,
    ConfigOption,
    JsonOption,
    KnownHostsOption,
    SshConfigOption,
    cli_command,
    console,
    print_json,
)
from jabascli.config import load_config
from jabascli.errors import InputError, JabasError
from jabascli.profiler.common import Reporter

app = typer.Typer(help="Measure what the solver needs, per device type.", no_args_is_help=True)

OutOption = Annotated[
    Path | None, typer.Option("--out", help="Output folder (default: the folder named in the config's \\[profiles]).")
]
ServerOption = Annotated[
    str | None, typer.Option("--server", help="This node's server name in the config (default: the first server).")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Measure again what is already on disk.")]
LaunchedOption = Annotated[
    bool,
    typer.Option(
        "--launched",
        hidden=True,
        help="Run by `jabas profile all` of a cluster: progress as JSON lines on stdout, and stop as Ctrl-C "
        "would when standard input closes.",
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="torch threads per measuring process (default on the CPU: what `jabas run` gives each trainer, "
        "the cores over the trainers on this machine)."
    ),
]


class _ProgressReporter(Reporter):
    """Renders a profiler's progress as one Rich bar, and its notes as lines above it.

    Nothing is shown until the profiler reports, so bad input ends with its message alone.
    """

    def __init__(self, title: str) -> None:
        self._title = title
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task: TaskID | None = None

    def _started(self) -> TaskID:
        if self._task is None:
            console.print(f"[bold]{self._title}[/bold]")
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self._task

    def progress(self, completed: float, total: float | None, what: str) -> None:
        self._progress.update(self._started(), completed=completed, total=total, description=escape(what))

    def note(self, message: str) -> None:
        self._started()
        self._progress.console.print(f"  {message}", highlight=False, markup=False)  # "[fast] ..." is text

    def stop(self) -> None:
        if self._task is not None:
            self._progress.stop()


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM stops a profiler as Ctrl-C does: measuring processes killed, no partial files."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _reporting(title: str, quiet: bool) -> Iterator[Reporter]:
    with _terminate_as_interrupt():
        if quiet:
            yield Reporter()
            return
        reporter = _ProgressReporter(title)
        try:
            yield reporter
        finally:
            reporter.stop()


def _emit(line: str) -> None:
    typer.echo(line)  # flushed: the launcher shows it as it comes


@contextmanager
def _launched_reporting() -> Iterator[Reporter]:
    """``--launched``: this command's pid, then its progress, as event lines; the end of standard input
    stops it as Ctrl-C does (its launcher closed it, or the SSH session dropped)."""
    from jabascli.elastic.lifeline import end_when_closed
    from jabascli.profiler.remote import LineReporter, event_line

    with _terminate_as_interrupt():
        _emit(event_line("pid", pid=os.getpid()))
        end_when_closed(sys.stdin.fileno())
        yield LineReporter(_emit)


@contextmanager
def _launched_errors(launched: bool) -> Iterator[None]:
    """``--launched``: an error is an event line for the launcher (which names the server), and the exit code."""
    if not launched:
        yield
        return
    from jabascli.profiler.remote import event_line

    try:
        yield
    except JabasError as exc:
        _emit(event_line("error", code=exc.exit_code, lines=exc.lines()))
        raise typer.Exit(exc.exit_code) from None


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


@app.command()
@cli_command
def mem(
    config: ConfigOption,
    out: OutOption = None,
    server: ServerOption = None,
    lbs: Annotated[int, typer.Option(help="Local batch size to start from.")] = 32,
    search: Annotated[
        str, typer.Option(help="dynamic: grow the LBS until one VSW no longer fits; static: only --lbs.")
    ] = "dynamic",
    lbs_step: Annotated[int | None, typer.Option(help="LBS increment of a dynamic search (default: --lbs).")] = None,
    max_lbs: Annotated[
        int | None,
        typer.Option(help="Largest LBS a dynamic search tries (default: 16 x --lbs, or gbs_max if smaller)."),
    ] = None,
    max_vsw: Annotated[int, typer.Option(help="Never try more VSWs than this.")] = 64,
    trial_iters: Annotated[int, typer.Option(help="Training iterations per trial.")] = 3,
    threads: ThreadsOption = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Memory profile: the largest VSW count that fits, per local batch size.

    Each trial trains a few iterations in a process of its own; the search
    doubles the VSW count until it fails, then bisects. On a GPU a trial fails
    on a real out-of-memory error; on the CPU or an emulated device, when its
    peak tensor memory exceeds the device's budget.

    Writes <out>/<LBS>/<server>/max_memory_profile_info.json.

    Example:

        jabas profile mem -c jabas.toml --lbs 16 --search dynamic
    """
    from jabascli.profiler.memory import profile_memory

    loaded = load_config(config, check_profiles=False)
    with _reporting("Memory profile", json_out) as reporter:
        run = profile_memory(
            loaded,
            server=server,
            out=out,
            lbs=lbs,
            search=search,
            lbs_step=lbs_step,
            max_lbs=max_lbs,
            max_vsw=max_vsw,
            iterations=trial_iters,
            threads=threads,
            force=force,
            reporter=reporter,
        )
    if json_out:
        print_json(
            {
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
        )
        return
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


@app.command()
@cli_command
def comp(
    config: ConfigOption,
    out: OutOption = None,
    server: ServerOption = None,
    memory_dir: Annotated[
        Path | None, typer.Option(help="Memory profile folder to read (default: the config's \\[profiles]).")
    ] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up iterations before measuring.")] = 5,
    iters: Annotated[
        int, typer.Option(help="Measured iterations per configuration (more, up to 4x, until the median is stable).")
    ] = 20,
    cooldown: Annotated[
        float | None, typer.Option(help="Seconds to pause between runs (default: 10 on a GPU, 0 on the CPU).")
    ] = None,
    synthetic_data: Annotated[
        bool, typer.Option(help="Time the workload's synthetic batches instead of loading its training set.")
    ] = False,
    threads: ThreadsOption = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Computation profile: data, forward, backward, update, copy time per (LBS, VSW).

    Measures 1 VSW, the maximum, and one between, at every LBS of this
    server's memory profile, each in a process of its own.

    Writes <out>/<LBS>/<server>/<server>_<model>_<LBS>_<VSW>_comp_profile.json.

    Example:

        jabas profile comp -c jabas.toml --iters 30
    """
    from jabascli.profiler.comp import profile_comp

    loaded = load_config(config, check_profiles=False)
    with _reporting("Computation profile", json_out) as reporter:
        run = profile_comp(
            loaded,
            server=server,
            out=out,
            memory_dir=memory_dir,
            warmup=warmup,
            iters=iters,
            cooldown=cooldown,
            threads=threads,
            synthetic_data=synthetic_data,
            force=force,
            reporter=reporter,
        )
    if json_out:
        print_json(
            [
                {"path": str(r.path), "skipped": r.skipped, **r.profile.model_dump(exclude_none=True)}
                for r in run.results
            ]
        )
        return
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


@app.command()
@cli_command
def bucket(
    config: ConfigOption,
    out: OutOption = None,
    bucket_cap_mb: Annotated[
        float | None, typer.Option(help="DDP bucket cap in MB (default: DDP's own, 25 MB with a small first bucket).")
    ] = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Gradient bucket sizes (MB) that DDP forms for the model, in gradient-ready order.

    Writes <out>/<model>_bucket_size_profile.json.

    Example:

        jabas profile bucket -c examples/resnet50.toml
    """
    from jabascli.profiler.bucket import profile_buckets

    loaded = load_config(config, check_profiles=False)
    with _reporting("Bucket profile", json_out) as reporter:
        run = profile_buckets(loaded, out=out, bucket_cap_mb=bucket_cap_mb, force=force, reporter=reporter)
    if json_out:
        print_json({"path": str(run.path), "skipped": run.skipped, **run.profile.model_dump(exclude_none=True)})
        return
    sizes = run.profile.bucket_size_distribution
    console.print(
        f"{run.profile.model}: {len(sizes)} bucket{'s' if len(sizes) != 1 else ''} "
        f"[{', '.join(f'{s:.2f}' for s in sizes)}] MB, {sum(sizes):.2f} MB in all"
        + (" (on disk)" if run.skipped else "")
    )
    console.print(f"written to {run.path}")


@app.command()
@cli_command
def comm(
    config: ConfigOption,
    out: OutOption = None,
    server: ServerOption = None,
    sizes: Annotated[str, typer.Option(help="Message sizes in MB: LO:HI (doubling) or a comma list.")] = "1:150",
    nprocs: Annotated[
        int | None, typer.Option(help="Processes on this node (default: the server's devices, at least 2 for intra).")
    ] = None,
    rank: Annotated[int | None, typer.Option(help="This node's rank (inter-node profile).")] = None,
    world: Annotated[int | None, typer.Option(help="Number of nodes (inter-node profile).")] = None,
    master: Annotated[str | None, typer.Option(help="ADDR:PORT of rank 0 (inter-node profile).")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up all-reduces per size.")] = 3,
    reps: Annotated[
        int | None, typer.Option(help="Timed all-reduces per size (default: about 1 s worth, 5 to 200).")
    ] = None,
    backend: Annotated[str | None, typer.Option(help="gloo or nccl (default: nccl on GPUs, else gloo).")] = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
    launched: LaunchedOption = False,
) -> None:
    """All-reduce time per message size, intra-node (and inter-node with --rank/--world/--master).

    Writes ideal_ms,measured_ms lines to intra_comm_profile_data.txt or
    inter_comm_profile_data.txt, and the bandwidth and world size behind
    ideal_ms to intra_comm_profile_meta.json or inter_comm_profile_meta.json.

    Example:

        jabas profile comm -c jabas.toml --nprocs 2

        jabas profile comm -c jabas.toml --rank 0 --world 2 --master 10.0.0.5:29500
    """
    from jabascli.profiler.comm import profile_comm, profile_hosts
    from jabascli.profiles.formats import BUCKET_MB

    with _launched_errors(launched):
        loaded = load_config(config, check_profiles=False)
        reporting = _launched_reporting() if launched else _reporting("Communication profile", json_out)
        with reporting as reporter:
            run = profile_comm(
                loaded,
                server=server,
                out=out,
                sizes=sizes,
                nprocs=nprocs,
                rank=rank,
                world=world,
                master=master,
                warmup=warmup,
                reps=reps,
                backend=backend,
                force=force,
                reporter=reporter,
            )
    profile = run.profile
    if launched:
        from jabascli.profiler.remote import event_line

        meta = profile.meta
        world_size = meta.world_size if meta is not None else None
        hosts = profile_hosts(profile)
        sizes_done = len(profile.measured_ms)
        _emit(
            event_line(
                "result", path=str(run.path), skipped=run.skipped, world_size=world_size, hosts=hosts, sizes=sizes_done
            )
        )
        return
    if json_out:
        print_json({"path": str(run.path), "skipped": run.skipped, **profile.model_dump(exclude_none=True)})
        return
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


@app.command("all")
@cli_command
def all_(
    config: ConfigOption,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="This node's server only: profiles it here, and prints the inter-node commands every node "
            "would run (default: every server, each on its node).",
        ),
    ] = None,
    lbs: Annotated[
        int | None,
        typer.Option(
            help="Sweep LBS N, 2N, 3N ... (default: the powers of two balanced splits of the GBS range need, "
            "e.g. 16, 32, 64, 128, 256 for GBS 64..256 on a fast and a 3x slower device)."
        ),
    ] = None,
    gbs_max: Annotated[
        int | None,
        typer.Option(
            help="Largest GBS the job trains (default: \\[batching] gbs_max, else initial_gbs): no VSW count "
            "or LBS above it is measured."
        ),
    ] = None,
    gbs_min: Annotated[
        int | None,
        typer.Option(help="Smallest GBS the job trains, e.g. 64 (default: \\[batching] gbs_min, else initial_gbs)."),
    ] = None,
    iters: Annotated[int, typer.Option(help="Measured iterations per computation point (more until stable).")] = 20,
    sizes: Annotated[
        str | None,
        typer.Option(help="All-reduce sizes in MB, LO:HI or a list (default: from the bucket profile)."),
    ] = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
    hybrid: Annotated[
        bool,
        typer.Option(
            "--hybrid",
            help="Also the hybrid planner's profiles (`jabas profile hybrid`; always when the job has \\[parallel]).",
        ),
    ] = False,
    known_hosts: KnownHostsOption = None,
    ssh_config: SshConfigOption = None,
    accept_new_host_keys: AcceptNewHostKeysOption = False,
    launched: LaunchedOption = False,
) -> None:
    """Every profile the solver needs, in one command: buckets, memory and computation per server, all-reduce.

    With every server of the config on this machine (loopback, emulated or
    not): each server, the intra-node all-reduce and the inter-node one over
    loopback, one process per server.

    On a cluster (servers whose host is another machine) it checks every node
    over SSH first, as `jabas run` does, then profiles each server on its own
    node, one after another (on an emulated cluster the nodes share this
    machine's cores, and servers profiled at once would measure each other),
    and then the all-reduce between the nodes, every node at once, rank 0's
    node the master at its host from the config. Each node's output is shown
    with its name; Ctrl-C stops the profilers on every node. The nodes read and
    write the job's files at the same paths (a shared file system).

    --server NAME profiles only that server, on this node, and prints the
    `jabas profile comm --rank/--world/--master` commands the nodes would run
    together for the inter-node profile. Files already on disk are kept
    (--force measures again); Ctrl-C leaves only complete files.

    Example:

        jabas profile all -c examples/two_servers.toml

        jabas profile all -c cluster.toml --known-hosts ~/.ssh/known_hosts --gbs-max 256

        jabas profile all -c jabas.toml --server node1 --gbs-max 1024
    """
    from jabascli.profiler.common import servers_here
    from jabascli.profiler.suite import failure_error, profile_all

    with _launched_errors(launched):
        loaded = load_config(config, check_profiles=False)
        ssh = None
        if known_hosts is not None or ssh_config is not None or accept_new_host_keys:
            if server is not None or not servers_here(loaded)[1]:
                raise InputError.at(
                    None, "--known-hosts", "is used on a cluster only (servers on other machines, no --server)"
                )
            from jabascli.elastic.remote import SshOptions

            ssh = SshOptions(known_hosts, ssh_config, accept_new_host_keys)
        began = time.monotonic()
        reporting = _launched_reporting() if launched else _reporting("All profiles", json_out)
        with reporting as reporter:
            if server is None and servers_here(loaded)[1]:  # servers on other machines: each on its node
                from jabascli.profiler.remote import ClusterOptions, profile_cluster

                measure = ClusterOptions(lbs, gbs_max, gbs_min, iters, sizes, force, hybrid)
                run = profile_cluster(loaded, measure, ssh=ssh, reporter=reporter)
            else:
                run = profile_all(
                    loaded,
                    server=server,
                    lbs=lbs,
                    gbs_max=gbs_max,
                    gbs_min=gbs_min,
                    iters=iters,
                    sizes=sizes,
                    force=force,
                    reporter=reporter,
                    hybrid=hybrid,
                )
    took = time.monotonic() - began
    stages = [{"name": s.name, "ok": s.ok, "detail": s.detail, "seconds": round(s.seconds, 1)} for s in run.stages]
    if launched:  # failed stages are the launcher's to name
        from jabascli.profiler.remote import event_line

        _emit(event_line("result", stages=stages, bucket_mib=run.bucket_mib, gbs_max=run.gbs_max))
        return
    failure = failure_error(run)
    if json_out:
        print_json(
            {
                "gbs_max": run.gbs_max,
                "lbs_values": run.lbs_values,
                "expected_s": round(run.expected_s, 1),
                "took_s": round(took, 1),
                "stages": stages,
                "commands": run.commands,
            }
        )
    else:
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
        elif failure is None:
            console.print(f"ready: `jabas solve -c {config} --gbs N`, or `jabas run -c {config} --gbs N`")
    if failure is not None:
        raise failure


@app.command()
@cli_command
def summary(
    folder: Annotated[Path, typer.Argument(help="A profile folder (or the memory/computation folder).")],
    json_out: JsonOption = False,
) -> None:
    """Print the memory and computation profiles as a table (LBS x device type).

    Each cell: the most VSWs that fit, and at the measured VSW count with the
    highest throughput, the time per iteration and samples per second.

    Example:

        jabas profile summary profiles/
    """
    from jabascli.profiler.summary import summarize_profiles

    result = summarize_profiles(folder)
    if json_out:
        print_json(
            {
                "model": result.model,
                "rows": [
                    {
                        "lbs": r.lbs,
                        "server": r.server,
                        "device_type": r.device_type,
                        "max_vsw": r.max_vsw,
                        "points": {
                            n: {"total_ms": p.total_time, "samples_per_s": r.throughput(n)}
                            for n, p in sorted(r.points.items())
                        },
                    }
                    for r in result.rows
                ],
            }
        )
        return
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


@app.command()
@cli_command
def hybrid(
    config: ConfigOption,
    out: Annotated[
        Path | None, typer.Option("--out", help="Profiles folder to write <out>/hybrid/ into (default: the config's).")
    ] = None,
    mbs: Annotated[str, typer.Option(help="Micro-batch sizes to time, a comma-separated list.")] = "1,2,4,8",
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """The hybrid planner's profiles of the job's workload on the servers of this machine.

    Per block and device type: forward and backward seconds by micro-batch
    size, plain and checkpointed (TP 2 and sharding over 2 measured on two
    processes where the workload allows), parameter, activation and output
    bytes, optimizer state and what its step allocates; and all-reduce,
    all-gather, reduce-scatter and send on gloo. An emulated server's device
    type is measured running its emulation. Writes <out>/hybrid/
    (docs/formats.md), which `jabas solve --hybrid` reads.

    Example:

        jabas profile hybrid -c jabas.toml --mbs 1,2,4
    """
    from jabascli.profiler.hybrid import profile_hybrid

    sizes = _mbs_list(mbs)
    loaded = load_config(config, check_profiles=False)
    with _reporting("Hybrid profiles", json_out) as reporter:
        result = profile_hybrid(loaded, out=out, mbs=sizes, force=force, reporter=reporter)
    if json_out:
        print_json({"model": result.model, "devices": result.devices, "written": [str(p) for p in result.written]})
        return
    state = "already on disk" if result.skipped else f"written: {len(result.written)} files"
    console.print(f"{result.model} on {', '.join(result.devices)}: {state}", highlight=False)


def _mbs_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise InputError.at(None, "--mbs", f"expected positive integers separated by commas, got {text!r}")
    return values


@app.command("import")
@cli_command
def import_(
    folder: Annotated[Path, typer.Argument(help="The published profiles: a checkout of the planner's repository.")],
    source: Annotated[str, typer.Option("--from", help="Whose profiles: sailor or galvatron.")],
    out: Annotated[Path, typer.Option("--out", help="Profiles folder to write <out>/hybrid/ into.")],
    json_out: JsonOption = False,
) -> None:
    """Convert a hybrid planner's published per-layer profiles into jabas's hybrid profiles.

    Writes <out>/hybrid/<model>/blocks.json, device-<type>.json per device
    type and <out>/hybrid/network.json (docs/formats.md); each file atomically.

    Example:

        jabas profile import --from sailor ../shared/reference/planners/sailor --out profiles/
    """
    from jabascli.profiles.hybrid import write_profiles
    from jabascli.profiles.hybrid_import import import_profiles

    imported = import_profiles(source, folder)
    written = {model: [str(p) for p in write_profiles(out, profiles)] for model, profiles in imported.items()}
    if json_out:
        print_json(written)
        return
    for model, profiles in imported.items():
        console.print(
            f"{model}: {profiles.num_blocks} blocks, device types {', '.join(sorted(profiles.devices))}",
            highlight=False,
        )
    console.print(f"written under {escape(str(out / 'hybrid'))}", highlight=False)
