"""``jabas schedule``, ``jabas worker``, ``jabas token`` and ``jabas job``: the elastic runtime."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, err_console, print_json
from jabascli.config import LoadedConfig, load_config
from jabascli.errors import InputError

if TYPE_CHECKING:
    from jabascli.elastic.ended import Ended
    from jabascli.elastic.protocol import JobStatus, MoveRecord
    from jabascli.elastic.remote import SshOptions

SchedulerOption = Annotated[
    str | None, typer.Option("--scheduler", help="ADDR:PORT of the scheduler (default: \\[scheduler] address:port).")
]


def _address(loaded: LoadedConfig, scheduler: str | None) -> str:
    if scheduler:
        return scheduler
    cfg = loaded.config.scheduler
    return f"{cfg.address}:{cfg.port}"


@cli_command
def schedule(
    config: ConfigOption,
    address: Annotated[str | None, typer.Option(help="Address to bind (default: \\[scheduler] address).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default: \\[scheduler] port).")] = None,
    new_token: Annotated[
        Path | None, typer.Option("--new-token", help="First write a fresh token (mode 0600) to this file, and use it.")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Start from the job's checkpoint in \\[storage] checkpoint_dir, if any."),
    ] = False,
    loopback_trainers: Annotated[
        bool, typer.Option("--loopback-trainers", hidden=True, help="Rendezvous on 127.0.0.1 (jabas run --elastic).")
    ] = False,
    servers: Annotated[
        str | None,
        typer.Option(
            help="Servers of the first plan, as `jabas run --servers`: auto (default: leave out any that slows "
            "the job), all, or a list: a,b."
        ),
    ] = None,
) -> None:
    """Run the elastic scheduler on the main node until the job is over.

    It starts the job once the workers of its servers have registered, moves it
    when asked (`jabas job move`), and restarts it from its checkpoint when a
    trainer or a node fails. It binds to loopback unless configured, and every
    request must carry the token of \\[scheduler] token_file (or JABAS_TOKEN).

    Example:

        jabas schedule -c jabas.toml --new-token ~/.jabas/token
    """
    from jabascli.elastic.agent import check_writable
    from jabascli.elastic.ended import clear_ended, write_ended
    from jabascli.elastic.job import TERMINAL, Scheduler
    from jabascli.elastic.service import serve
    from jabascli.elastic.token import load_token, read_token_file, write_token
    from jabascli.engine.layout import checkpoint_folder

    loaded = load_config(config)
    token = load_token(loaded) if new_token is None else ""  # a new token is written once the inputs are checked
    planner = None
    if loaded.config.scaling.enabled:
        from jabascli.elastic.autoscaling import AutoScaler

        planner = AutoScaler(loaded)  # reads the profiles and the training set's size once
    scheduler = Scheduler(loaded, resume=resume, planner=planner, servers=servers)
    # The inputs are checked: now the folder and the token may be made.
    check_writable(checkpoint_folder(loaded))
    if new_token is not None:
        write_token(new_token)
        token = read_token_file(new_token)
    cfg = loaded.config.scheduler
    host, bind_port = address or cfg.address, port or cfg.port
    err_console.print(f"scheduler of {loaded.config.job.name!r} listening on {host}:{bind_port}", highlight=False)
    if loopback_trainers:
        scheduler.master_addr = "127.0.0.1"  # every server's agent runs on this machine
    clear_ended(loaded)
    status = serve(scheduler, token, host, bind_port)
    if status.state in TERMINAL:
        write_ended(loaded, status)  # `jabas job status` answers from it once the scheduler is gone
    console.print(f"job {status.job}: {status.state}: {status.message}", highlight=False, markup=False)
    if status.state == "failed":
        raise typer.Exit(1)


@cli_command
def worker(
    config: ConfigOption,
    rank: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="This node's rank: its server's index in \\[\\[cluster.servers]] (inside a Slurm job: from Slurm).",
        ),
    ] = None,
    scheduler: SchedulerOption = None,
    stdin: Annotated[
        bool,
        typer.Option(
            "--stdin",
            help="Read the token from a launch order on standard input, and end (trainers too) when standard "
            "input closes: how `jabas run` starts agents on other machines over SSH.",
        ),
    ] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Inside a Slurm job (started by srun): this node's server, the scheduler and the token from "
            "Slurm's environment and the job's folder (the default when --rank is not given and SLURM_JOB_ID is set).",
        ),
    ] = False,
) -> None:
    """Run the agent of one node: register with the scheduler, start and stop trainers.

    Retries an unreachable scheduler for \\[scheduler] connect_timeout_s, then exits 1.
    With --stdin, SIGTERM or the end of standard input ends its trainers (SIGTERM,
    then SIGKILL) before it exits. With --slurm, SIGTERM (scancel) is left to the
    scheduler, which stops the job at the next iteration with a checkpoint.

    Example:

        jabas worker -c jabas.toml --rank 1 --scheduler 10.0.0.1:40000
        srun jabas worker -c jabas.toml --slurm     # one per node of a Slurm job
    """
    import os
    import sys

    agents: list[WorkerAgent] = []
    if rank is None or slurm:  # inside a Slurm job: SIGTERM held from here on, before torch starts threads
        from jabascli.elastic.slurm import hold_sigterm, in_allocation, leave_if_idle

        if not (slurm or in_allocation()):
            raise InputError.at(None, "--rank", "is needed outside a Slurm job")
        hold_sigterm(lambda: leave_if_idle(agents))  # trainers inherit SIGTERM blocked: the scheduler stops them

    from jabascli.elastic.agent import WorkerAgent
    from jabascli.elastic.client import SchedulerClient
    from jabascli.elastic.lifeline import end_when_closed, exit_on_sigterm, read_order
    from jabascli.elastic.token import load_token

    if stdin:
        order = read_order(sys.stdin.buffer)
        os.environ.update(order.env)
        exit_on_sigterm()
        end_when_closed(sys.stdin.fileno())
    loaded = load_config(config)
    if rank is None or slurm:
        from jabascli.elastic.slurm import worker_place

        place = worker_place(loaded, scheduler)
        rank, token, address = place.rank, place.token, place.scheduler
    else:
        token = order.token if stdin else load_token(loaded)
        address = _address(loaded, scheduler)
    if stdin:  # the launcher reads the pid, to kill this agent should its lifeline not end it
        err_console.print(f"worker rank {rank}, pid {os.getpid()}, scheduler {address}", highlight=False, markup=False)
    with SchedulerClient(address, token) as client:
        agents.append(WorkerAgent(loaded, rank, client))
        agents[0].run()


@cli_command
def token(
    file: Annotated[Path, typer.Argument(help="Where to write the token (mode 0600); replaced atomically.")],
) -> None:
    """Write a fresh random token for the scheduler and its workers.

    Copy it to every node (mode 0600) and name it in \\[scheduler] token_file, or
    pass it in JABAS_TOKEN.

    Example:

        jabas token ~/.jabas/token
    """
    from jabascli.elastic.token import write_token

    write_token(file)
    console.print(f"wrote a new token to {file} (mode 0600)", highlight=False)


job_app = typer.Typer(help="Look at and steer a job run by `jabas schedule`.", no_args_is_help=True)


def _client(config: Path, scheduler: str | None):  # type: ignore[no-untyped-def]
    from jabascli.elastic.client import SchedulerClient
    from jabascli.elastic.local import find_steering
    from jabascli.elastic.token import load_token, read_token_file

    loaded = load_config(config)
    steering = find_steering(loaded) if scheduler is None else None
    if steering is not None:  # a `jabas run --elastic` of this job is running here
        return SchedulerClient(steering.address, read_token_file(steering.token_file))
    return SchedulerClient(_address(loaded, scheduler), load_token(loaded))


def _ended(config: Path, scheduler: str | None) -> Ended | None:
    """The record of this job's end, when it is over (no scheduler of it runs here); None: ask the scheduler."""
    from jabascli.elastic.ended import read_ended
    from jabascli.elastic.local import find_steering

    if scheduler is not None:
        return None
    loaded = load_config(config)
    return read_ended(loaded) if find_steering(loaded) is None else None


def _refuse_if_ended(config: Path, scheduler: str | None, what: str) -> None:
    ended = _ended(config, scheduler)
    if ended is not None:
        raise InputError.at(None, None, f"{ended.line()}: nothing to {what}")


@job_app.command("status")
@cli_command
def job_status(config: ConfigOption, scheduler: SchedulerOption = None, json_out: JsonOption = False) -> None:
    """Show the job: state, allocation, plan, progress, restarts, moves and their downtime.

    Once the job is over (the scheduler wrote ended.json to its run folder), how it
    ended, when, and where its results are.

    Example:

        jabas job status -c jabas.toml
    """
    ended = _ended(config, scheduler)
    if ended is not None:  # the job is over: its run folder says how
        if json_out:
            print_json(
                {
                    **ended.status.model_dump(mode="json"),
                    "ended_at": ended.ended_at,
                    "run_folder": str(ended.run_folder),
                }
            )
            return
        console.print(ended.line(), highlight=False, markup=False)
        _print_moves(ended.status)
        return
    with _client(config, scheduler) as client:
        status = client.status()
    if json_out:
        print_json(status.model_dump(mode="json"))
        return
    loss = "-" if status.loss is None else f"{status.loss:.4f}"
    console.print(
        f"[bold]{status.job}[/bold]: {status.state}, epoch {status.epoch}/{status.epochs}, step {status.step}, "
        f"loss {loss}, GBS {status.gbs or '-'}, restarts {status.restarts}/{status.max_restarts}",
        highlight=False,
    )
    console.print(f"on {', '.join(status.allocation)}: {status.plan or '-'}", highlight=False, markup=False)
    if status.message:
        console.print(status.message, highlight=False, markup=False)
    if status.scaling is not None:
        from jabascli.elastic.autoscaling import describe

        console.print(f"planner: {describe(status.scaling)}", highlight=False, markup=False)
    _print_moves(status)


def _print_moves(status: JobStatus) -> None:
    if status.moves:
        table = Table(title="moves and restarts")
        for column in ("generation", "why", "from", "to", "downtime ms"):
            table.add_column(column)
        for m in status.moves:
            downtime = "-" if m.downtime_s is None else f"{m.downtime_s * 1e3:.1f}"
            why = f"{m.reason} (in place)" if m.in_place else m.reason
            if m.steps_lost is not None:  # a failure: how long to the next iteration, and the steps done again
                why += f", {m.steps_lost} steps lost, next iteration {m.recovered_s or 0:.2f} s after"
            table.add_row(str(m.generation), why, ",".join(m.from_servers), ",".join(m.to_servers), downtime)
        console.print(table)


@job_app.command("move")
@cli_command
def job_move(
    config: ConfigOption,
    servers: Annotated[list[str], typer.Argument(help="The servers to move to (names of \\[\\[cluster.servers]]).")],
    now: Annotated[bool, typer.Option("--now", help="At the next iteration, not the next epoch end.")] = False,
    scheduler: SchedulerOption = None,
) -> None:
    """Move the job to other servers at the next epoch end (or iteration, with --now).

    Example:

        jabas job move -c jabas.toml node0 node1
    """
    _refuse_if_ended(config, scheduler, "move")
    with _client(config, scheduler) as client:
        status = client.move(servers, "now" if now else "epoch")
    console.print(f"{status.state}: {status.message}", highlight=False, markup=False)


@job_app.command("stop")
@cli_command
def job_stop(
    config: ConfigOption,
    at_epoch_end: Annotated[bool, typer.Option("--at-epoch-end", help="Wait for the epoch to end.")] = False,
    scheduler: SchedulerOption = None,
) -> None:
    """Stop the job: its trainers write a checkpoint and exit, then the scheduler and workers end.

    Example:

        jabas job stop -c jabas.toml
    """
    _refuse_if_ended(config, scheduler, "stop")
    with _client(config, scheduler) as client:
        status = client.stop("epoch" if at_epoch_end else "now")
    console.print(f"{status.state}: {status.message}", highlight=False, markup=False)


def check_elastic_inputs(loaded: LoadedConfig, servers: str | None, **unsupported: object) -> None:
    """What ``jabas run --elastic`` refuses before it changes anything: options it does not take, missing profiles,
    a first plan that cannot be solved (the scheduler plans it as ``jabas run`` does)."""
    from jabascli.solver.autoplan import solve_for_run

    given = [f"--{name.replace('_', '-')}" for name, value in unsupported.items() if value is not None]
    if given:
        raise InputError.at(
            None, given[0], "is not used with --elastic: the scheduler plans and resumes from [storage] checkpoint_dir"
        )
    if loaded.config.scaling.enabled:
        from jabascli.elastic.autoscaling import scaling_setup

        scaling_setup(loaded)  # missing profiles: one line here, not only in the scheduler's log
    solve_for_run(loaded, None, loaded.config.job.plan is not None, servers)


def run_elastic_here(
    loaded: LoadedConfig,
    json_out: bool,
    config: Path,
    resuming: bool = False,
    port: int | None = None,
    token_file: Path | None = None,
    ssh: SshOptions | None = None,
    servers: str | None = None,
) -> None:
    """``jabas run --elastic`` and ``jabas run`` on a cluster (its inputs checked by :func:`check_elastic_inputs`):
    the scheduler here and an agent per server (here, or on its host over SSH), with a progress bar.

    ``resuming``: the job's checkpoint folder holds a checkpoint to continue from. Prints where the
    scheduler listens and its token file, and at the end the validation table as ``jabas run`` does.
    """
    import shlex

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from jabascli.cli.display import print_results
    from jabascli.elastic.local import Steering, run_elastic
    from jabascli.engine.layout import run_folder

    progress = Progress(
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(),
        TextColumn("epoch {task.fields[epoch]}  step {task.fields[step]}  on {task.fields[servers]}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
        disable=json_out,
        transient=True,
    )
    epochs = loaded.config.job.epochs
    shown: list[object] = []
    moved: set[int] = set()
    with progress:
        task = progress.add_task("job", total=epochs, state="starting", epoch="-", step=0, servers="-", loss="-")

        def show(status: JobStatus) -> None:
            if status.scaling is not None and status.scaling.get("time") not in shown:
                from jabascli.elastic.autoscaling import describe

                shown.append(status.scaling.get("time"))
                progress.console.print(f"planner: {describe(status.scaling)}", highlight=False, markup=False)
            for move in status.moves:  # each once, when its downtime is known
                if move.generation not in moved and move.downtime_s is not None and not json_out:
                    moved.add(move.generation)
                    progress.console.print(move_line(move), highlight=False, markup=False)
            loss = "-" if status.loss is None else f"{status.loss:.4f}"
            progress.update(
                task,
                completed=status.epoch,
                state=status.state,
                epoch=f"{min(status.epoch + 1, epochs)}/{epochs}",
                step=status.step,
                servers=",".join(status.allocation),
                loss=loss,
            )

        def steering(where: Steering) -> None:
            steer = f"jabas job status -c {shlex.quote(str(config))}"
            line = f"scheduler on {where.address}, token in {where.token_file} (steer it: `{steer}`)"
            (err_console if json_out else progress.console).print(line, highlight=False, markup=False)

        def node_line(server: str, line: str) -> None:
            if not json_out:
                progress.console.print(f"[{server}] {line}", highlight=False, markup=False)

        status = run_elastic(
            loaded,
            show,
            port=port,
            resume=resuming,
            token_file=token_file,
            on_steering=steering,
            ssh=ssh,
            on_line=node_line,
            servers=servers,
        )
    if json_out:
        print_json(status.model_dump(mode="json"))
        return
    for move in status.moves:
        if move.generation not in moved:  # no iteration followed it
            console.print(move_line(move), highlight=False, markup=False)
    console.print(
        f"{status.job}: {status.state}: {status.message}; results in {run_folder(loaded)}",
        highlight=False,
        markup=False,
    )
    if status.epoch_history:
        results = [record.model_dump() for record in status.epoch_history]
        print_results(f"{status.job}: GBS {status.gbs or '-'}, {status.plan or ''}", results)
    if status.state == "failed":
        raise typer.Exit(1)


def move_line(move: MoveRecord) -> str:
    """``moved A,B -> A at an epoch end (in place): downtime 12.3 ms, from step 40``: one move or restart."""
    where = f"{','.join(move.from_servers)} -> {','.join(move.to_servers)}"
    if move.reason == "recovery":
        lost = "" if move.steps_lost is None else f", {move.steps_lost} steps lost"
        if move.updates_taken_back:
            lost += f", {move.updates_taken_back} bucket updates of the interrupted step taken back"
        head = f"recovered {where} in place after a failure ({move.failure}){lost}"
    elif move.reason == "restart":
        head = f"restarted {where} after a failure"
        if move.failure:
            head += f" ({move.failure})"
    else:
        head = f"moved {where} at {'an epoch end' if move.when == 'epoch' else 'an iteration (--now)'}"
        head += " (in place)" if move.in_place else " (trainers restarted)"
    downtime = "-" if move.downtime_s is None else f"{move.downtime_s * 1e3:.1f} ms"
    step = "" if move.resumed_step is None else f", from step {move.resumed_step}"
    return f"{head}: downtime {downtime}{step}"
