"""``jabas validate``: check a config and summarise it."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, plural, print_json, replicas_line
from jabascli.config import LoadedConfig, load_config
from jabascli.config.models import ParallelConfig


@cli_command
def validate(config: ConfigOption, json_out: JsonOption = False) -> None:
    """Check a job config (TOML, or the seed JSON format) and print a summary.

    Every problem is printed on its own line with the file and the field path;
    the exit code is 2 when there is any. A TOML job's workload is imported, so
    a name that is no workload, or a file that fails to import, is caught here
    as `jabas run` would catch it. A seed config.json describes profiles, a GBS
    range and a cluster for solving, and no workload: its profiles are read as
    `jabas solve` reads them, and a last line says what a run would still need.

    Example:

        jabas validate -c jabas.toml

        jabas validate -c examples/seed/config.json --json
    """
    loaded = load_config(config)
    if loaded.format == "seed-json":
        profiled = check_seed_profiles(loaded)
    else:
        from jabascli.workload import workload_of

        workload_of(loaded)  # what `jabas run` checks first: the workload exists and imports
    if json_out:
        print_json({"file": str(loaded.path), "format": loaded.format, "config": loaded.config.model_dump(mode="json")})
        return
    if loaded.format == "seed-json":
        print_seed_summary(loaded, profiled, config)
        return
    print_summary(loaded)


def check_seed_profiles(loaded: LoadedConfig) -> bool:
    """Read a seed config's profiles as `jabas solve` does (bad or missing ones raise); False when it names none."""
    from jabascli.solver import solver_from_config

    if not loaded.profile_dirs().computation.is_dir():
        return False  # a seed config without profile folders: nothing to read yet
    solver_from_config(loaded)
    return True


def print_seed_summary(loaded: LoadedConfig, profiled: bool, typed: Path) -> None:
    """A seed config.json for what it is: a GBS range, a cluster and profiles to solve from."""
    cfg = loaded.config
    console.print(f"[green]✓[/green] {loaded.path} (seed-json) is valid")
    job = Table(title="Solving", show_header=False)
    b = cfg.batching
    if b.gbs_min is not None or b.gbs_max is not None:
        job.add_row(
            "global batch size", f"{b.gbs_min or '-'} .. {b.gbs_max or '-'} (similarity target {b.similarity_target:g})"
        )
    else:
        job.add_row("global batch size", "(no range: give jabas solve --gbs N)")
    job.add_row("allocation unit", f"{cfg.scaling.allocation_unit} GPU(s)")
    job.add_row("cluster info", str(loaded.cluster_info_path))
    console.print(job)
    servers = Table(title="Servers")
    for column in ("name", "device type", "devices", "TFLOPS", "available"):
        servers.add_column(column)
    available = {s.name for s in cfg.available()}
    for s in cfg.cluster.servers:
        servers.add_row(s.name, s.device_type, str(s.devices), f"{s.tflops:g}", "yes" if s.name in available else "no")
    console.print(servers)
    print_profile_folders(loaded, "read" if profiled else "not yet")
    needs = "a workload, which the seed's format does not hold: a jabas.toml with [job] workload, this cluster"
    needs += " and these profiles" if profiled else " and its profiles (`jabas profile all`)"
    console.print(
        f"a run needs {needs}; `jabas solve -c {typed} --gbs N` and `jabas simulate -c {typed}` take this file"
        " as it is",
        highlight=False,
        markup=False,
    )


def print_summary(loaded: LoadedConfig) -> None:
    cfg = loaded.config
    console.print(f"[green]✓[/green] {loaded.path} ({loaded.format}) is valid")
    job = Table(title="Job", show_header=False)
    job.add_row("workload", cfg.job.workload or "(none)")
    job.add_row("epochs", str(cfg.job.epochs))
    job.add_row("local batch size", str(cfg.job.lbs or "(from plan or solver)"))
    job.add_row("weight sync", cfg.job.weight_sync)
    job.add_row("precision", cfg.job.precision)
    clip = cfg.job.clip_grad_norm
    job.add_row("clip grad norm", "(the workload's, if any)" if clip is None else f"{clip:g}")
    workers = cfg.job.loader_workers
    job.add_row("loader workers", "(0 on CPU/emulated, 2 per GPU)" if workers is None else str(workers))
    b = cfg.batching
    if b.metric == "fixed":
        job.add_row("global batch size", escape(fixed_gbs(loaded)))  # "[batching]" is text, not markup
    else:
        target = f", target {b.similarity_target:g}" if b.metric == "similarity" else ""
        job.add_row("global batch size", f"{b.gbs_min or '-'} .. {b.gbs_max or '-'} ({b.metric}{target})")
    if cfg.parallel is not None:
        job.add_row("layout", escape(layout_summary(loaded, cfg.parallel)))
    job.add_row("allocation unit", f"{cfg.scaling.allocation_unit} GPU(s)")
    console.print(job)

    servers = Table(title="Servers")
    for column in ("name", "host", "device type", "devices", "TFLOPS", "VSW", "GA", "emulated", "available"):
        servers.add_column(column)
    available = {s.name for s in cfg.available()}
    for s in cfg.cluster.servers:
        emulated = f"x{s.emulate.slowdown:g}, {s.emulate.memory_bytes / 2**30:.2f} GiB" if s.emulate else "no"
        servers.add_row(
            s.name,
            s.host,
            s.device_type,
            str(s.devices),
            f"{s.tflops:g}",
            str(s.vsw),
            str(s.ga),
            emulated,
            "yes" if s.name in available else "no",
        )
    console.print(servers)

    print_profile_folders(loaded, "yes")


def fixed_gbs(loaded: LoadedConfig) -> str:
    """A fixed-GBS job's one GBS, and where it comes from."""
    from jabascli.engine.plan import plan_from_config

    cfg = loaded.config
    if cfg.batching.initial_gbs is not None:
        return (
            f"{cfg.batching.initial_gbs}, fixed ([batching] initial_gbs: the plan is solved for it from the profiles)"
        )
    if cfg.job.plan is not None:
        return f"fixed, the plan file's ({cfg.job.plan})"
    if cfg.job.lbs is None:
        return "fixed, once a run has [job] lbs, [batching] initial_gbs or a plan file"
    plan = plan_from_config(loaded)
    each = plural(plan.workers, "micro-batch", "micro-batches") if cfg.parallel else plural(plan.workers, "worker")
    return f"{plan.gbs}, fixed (LBS {plan.lbs} x {each}: the servers' VSW and GA)"


def layout_summary(loaded: LoadedConfig, lay: ParallelConfig) -> str:
    """A ``[parallel]`` job's layout and, where the config fixes it, each replica's micro-batches per iteration."""
    from jabascli.engine.plan import plan_from_config

    cfg = loaded.config
    if lay.plan == "auto":
        return "the hybrid planner's, solved for the GBS when the job runs ([parallel] plan = auto)"
    size = lay.tp * lay.pp
    text = f"tp {lay.tp}, pp {lay.pp}, sharding {lay.sharding}: replicas of {plural(size, 'device')}"
    if cfg.job.plan is not None or cfg.job.lbs is None:
        return text
    plan = plan_from_config(loaded)
    return f"{text}, {replicas_line(plan.replica_micro_batches(size))} (GBS {plan.gbs})"


def print_profile_folders(loaded: LoadedConfig, present: str) -> None:
    """The four profile folders; ``present`` is said of those that exist."""
    dirs = loaded.profile_dirs()
    profiles = Table(title="Profile folders")
    profiles.add_column("profile")
    profiles.add_column("folder")
    profiles.add_column("present")
    for name in ("memory", "computation", "communication", "bucket"):
        folder = getattr(dirs, name)
        profiles.add_row(name, str(folder), present if folder.is_dir() else "not yet")
    console.print(profiles)
