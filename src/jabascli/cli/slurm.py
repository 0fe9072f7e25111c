"""``jabas slurm submit`` and ``jabas slurm schedule``: a job as a Slurm batch job (docs/slurm.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import ConfigOption, cli_command, console, err_console
from jabascli.config import load_config

app = typer.Typer(
    help="Run a job as a Slurm batch job: one heterogeneous component per device type.", no_args_is_help=True
)


@app.command("submit")
@cli_command
def submit(
    config: ConfigOption,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write and show the script, do not submit it.")] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write the script (default: <run folder>/slurm/<job>.sbatch).")
    ] = None,
) -> None:
    """Write the job's sbatch script, show it, and submit it with sbatch.

    One heterogeneous component per device type of \\[\\[cluster.servers]] (its node
    count, --constraint=TYPE or --gres=gpu:TYPE:N, and \\[slurm] partition, time,
    account, options). On the allocation's first node the script runs `jabas slurm
    schedule`, and `jabas worker --slurm` on every node through srun; the token is
    generated into a 0600 file of the job's folder. A job with a checkpoint
    continues from it. `scancel` stops it at the next iteration, with a checkpoint.

    Example:

        jabas slurm submit -c jabas.toml --dry-run
        jabas slurm submit -c jabas.toml
    """
    from jabascli.atomic import atomic_write_text
    from jabascli.elastic.slurm_script import batch_script, script_path
    from jabascli.elastic.slurm_script import submit as sbatch

    loaded = load_config(config)
    text = batch_script(loaded, sys.executable)
    path = out or script_path(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    console.print(text, highlight=False, markup=False, end="")
    if dry_run:
        err_console.print(f"wrote {path} (not submitted: `sbatch {path}` submits it)", highlight=False, markup=False)
        return
    job_id = sbatch(path)
    output = path.parent / f"slurm-{job_id}.out"
    err_console.print(
        f"submitted Slurm job {job_id} ({path}); output in {output}; `jabas job status -c {config}` once it runs",
        highlight=False,
        markup=False,
    )


@app.command("schedule")
@cli_command
def schedule(config: ConfigOption) -> None:
    """Run the job's scheduler inside a Slurm job (what the script of `jabas slurm submit` runs on its first node).

    The job's servers are the allocation's nodes, each matched to its \\[\\[cluster.servers]]
    entry by name or host (Slurm's NodeName or NodeAddr); it listens on the host of the
    first node's server at \\[scheduler] port, resumes from the job's newest checkpoint if
    there is one, and stops the job with a checkpoint on SIGTERM. With \\[slurm]
    release_idle, it gives Slurm back the nodes of servers the job moves off.

    Example:

        jabas slurm schedule -c jabas.toml      # in an sbatch script, on the allocation's first node
    """
    from jabascli.elastic.slurm import serve_allocation

    loaded = load_config(config)

    def started(address: str, servers: list[str], resuming: bool) -> None:
        how = "resuming from its checkpoint" if resuming else "from the start"
        line = f"scheduler of {loaded.config.job.name!r} on {address}, servers {', '.join(servers)}, {how}"
        err_console.print(line, highlight=False, markup=False)

    def said(line: str) -> None:
        err_console.print(line, highlight=False, markup=False)

    status = serve_allocation(loaded, on_start=started, on_line=said)
    console.print(f"job {status.job}: {status.state}: {status.message}", highlight=False, markup=False)
    for move in status.moves:
        where = f"{','.join(move.from_servers)} -> {','.join(move.to_servers)}"
        console.print(f"generation {move.generation}: {move.reason} {where}", highlight=False, markup=False)
    if status.state == "failed":
        raise typer.Exit(1)
