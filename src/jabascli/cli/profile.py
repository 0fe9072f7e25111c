"""``jabas profile``: measure memory, computation, buckets and communication."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

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
from jabascli.cli.profile_hybrid import hybrid, import_
from jabascli.cli.profile_link import link
from jabascli.cli.profile_options import ForceOption, LaunchedOption, OutOption, ServerOption, ThreadsOption
from jabascli.cli.profile_progress import emit, launched_errors, launched_reporting, reporting
from jabascli.cli.profile_tables import (
    memory_json,
    print_comm,
    print_comp,
    print_memory,
    print_suite,
    print_summary,
    stages_json,
    summary_json,
)
from jabascli.config import load_config
from jabascli.errors import InputError
from jabascli.profiler.child import prepare_forked_children

app = typer.Typer(help="Measure what the solver needs, per device type.", no_args_is_help=True)


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
    prepare_forked_children()
    with reporting("Memory profile", json_out) as reporter:
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
        print_json(memory_json(run))
        return
    print_memory(run)


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
    prepare_forked_children()
    with reporting("Computation profile", json_out) as reporter:
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
    print_comp(run)


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
    with reporting("Bucket profile", json_out) as reporter:
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

    with launched_errors(launched):
        loaded = load_config(config, check_profiles=False)
        shown = launched_reporting() if launched else reporting("Communication profile", json_out)
        with shown as reporter:
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
        from jabascli.profiler.events import event_line

        meta = profile.meta
        world_size = meta.world_size if meta is not None else None
        hosts = profile_hosts(profile)
        sizes_done = len(profile.measured_ms)
        emit(
            event_line(
                "result", path=str(run.path), skipped=run.skipped, world_size=world_size, hosts=hosts, sizes=sizes_done
            )
        )
        return
    if json_out:
        print_json({"path": str(run.path), "skipped": run.skipped, **profile.model_dump(exclude_none=True)})
        return
    print_comm(run)


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
            help="Also the hybrid planner's profiles (`jabas profile hybrid`; always when the job has \\[parallel]); "
            "on a cluster, the link between the first two servers' nodes, into the hybrid profiles taken on one "
            "machine before.",
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
    write the job's files at the same paths (a shared file system). With
    --hybrid (or a job with \\[parallel]) the hybrid profiles must be on disk
    (`jabas profile hybrid -c CONFIG`, on one machine): last, `jabas profile
    link` measures the link between the first two servers' nodes into them.

    --server NAME profiles only that server, on this node, and prints the
    `jabas profile comm --rank/--world/--master` commands the nodes would run
    together for the inter-node profile. Files already on disk are kept
    (--force measures again); Ctrl-C leaves only complete files.

    Example:

        jabas profile all -c examples/two_servers.toml

        jabas profile all -c cluster.toml --known-hosts ~/.ssh/known_hosts --gbs-max 256

        jabas profile all -c cluster.toml --hybrid

        jabas profile all -c jabas.toml --server node1 --gbs-max 1024
    """
    from jabascli.profiler.common import servers_here
    from jabascli.profiler.suite import failure_error, profile_all

    with launched_errors(launched):
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
        on_nodes = server is None and bool(servers_here(loaded)[1])  # servers on other machines: each on its node
        if not on_nodes:
            prepare_forked_children()
        shown = launched_reporting() if launched else reporting("All profiles", json_out)
        with shown as reporter:
            if on_nodes:
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
    stages = stages_json(run)
    if launched:  # failed stages are the launcher's to name
        from jabascli.profiler.events import event_line

        emit(event_line("result", stages=stages, bucket_mib=run.bucket_mib, gbs_max=run.gbs_max))
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
        print_suite(run, took, config, ok=failure is None)
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
        print_json(summary_json(result))
        return
    print_summary(result)


app.command()(hybrid)
app.command()(link)
app.command("import")(import_)
