"""``jabas train`` and ``jabas run``: train a job."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jabascli.cli.common import (
    AcceptNewHostKeysOption,
    ConfigOption,
    JsonOption,
    KnownHostsOption,
    SshConfigOption,
    cli_command,
    console,
    err_console,
    plural,
    print_json,
    replicas_line,
)
from jabascli.cli.display import epoch_line, print_results
from jabascli.config import LoadedConfig, load_config
from jabascli.engine.options import TrainOptions
from jabascli.errors import InputError
from jabascli.forkserver import start_shared_server

if TYPE_CHECKING:
    from jabascli.engine.plan import TrainingPlan
    from jabascli.solver.autoplan import RunPlan

PlanOption = Annotated[
    Path | None, typer.Option("--plan", help="A plan from `jabas solve --out` (default: \\[job] plan).")
]
ResumeOption = Annotated[
    Path | None, typer.Option("--resume", help="Checkpoint to resume from: a file, or a job's checkpoint folder.")
]
CheckpointEveryOption = Annotated[
    int | None,
    typer.Option(
        "--checkpoint-every", min=1, help="Also checkpoint every N iterations (always: every epoch end and at exit)."
    ),
]
BucketCapOption = Annotated[
    float | None,
    typer.Option(
        "--bucket-cap-mb",
        min=0.0001,
        help="DDP gradient bucket size in MiB (default: [job] bucket_cap_mb, else DDP's own: 25 MiB after a first"
        " bucket of 1 MiB).",
    ),
]
MaxStepsOption = Annotated[
    int | None, typer.Option("--max-steps", min=1, help="Stop after N iterations in total (a checkpoint is written).")
]


@cli_command
def train(
    config: ConfigOption,
    plan: PlanOption = None,
    resume: ResumeOption = None,
    checkpoint_every: CheckpointEveryOption = None,
    max_steps: MaxStepsOption = None,
    bucket_cap_mb: BucketCapOption = None,
    metrics: Annotated[bool, typer.Option(help="Write metrics to the run folder (rank 0).")] = True,
) -> None:
    """Run one trainer process; rank and world come from the torch.distributed environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so it runs
    under plain torchrun as well as under `jabas run` and `jabas worker`.
    Without WORLD_SIZE it trains alone (a plan of one rank).

    Example:

        torchrun --nproc-per-node 2 -m jabascli train -c jabas.toml
    """
    from jabascli.engine.events import events_from_environment
    from jabascli.engine.process import run_trainer

    loaded = load_config(config)
    options = TrainOptions(
        plan=plan,
        resume=resume,
        checkpoint_every=checkpoint_every,
        max_steps=max_steps,
        bucket_cap_mb=bucket_cap_mb if bucket_cap_mb is not None else loaded.config.job.bucket_cap_mb,
        metrics=metrics,
    )
    # What the imports made never becomes garbage: frozen, it is left out of the full collection a
    # move in place or a recovery makes (engine/process.py), which would otherwise take 50-100 ms. DDP
    # imports torch._dynamo when it is first built (a third of those objects): imported first, to be frozen too.
    import torch._dynamo  # noqa: F401

    gc.freeze()
    run_trainer(loaded, options, on_event=events_from_environment() or _print_epoch)


def _print_epoch(event: dict[str, Any]) -> None:
    """Rank 0's report when no launcher listens: one line per epoch."""
    if event.get("event") == "epoch":
        console.print(epoch_line(event), highlight=False, markup=False)
    elif event.get("event") == "done" and event["results"] and event["results"][-1]["val_accuracy"] is not None:
        console.print(f"validation accuracy: {event['results'][-1]['val_accuracy']:.4f}")


@cli_command
def run(
    config: ConfigOption,
    plan: PlanOption = None,
    resume: ResumeOption = None,
    checkpoint_every: CheckpointEveryOption = None,
    max_steps: MaxStepsOption = None,
    bucket_cap_mb: BucketCapOption = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Start the job from scratch: its checkpoint and run folders are moved aside (renamed "
            "<job>.<time>), not deleted. Without it a rerun resumes from the newest intact checkpoint.",
        ),
    ] = False,
    gbs: Annotated[
        int | None,
        typer.Option(
            "--gbs", min=1, help="Solve the plan for this GBS from the profiles (default: \\[batching] initial_gbs)."
        ),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            min=0,
            help="Restart the trainers after a crash, at most N times, from the latest checkpoint "
            "(e.g. --max-restarts 3 --checkpoint-every 100).",
        ),
    ] = 0,
    elastic: Annotated[
        bool,
        typer.Option(
            "--elastic",
            help="Run under a local scheduler and one worker agent per server (as on real nodes), so "
            "`jabas job move` can move the job between servers; also with \\[scaling] enabled = true.",
        ),
    ] = False,
    port: Annotated[
        int | None, typer.Option(help="With --elastic: the scheduler's port on 127.0.0.1 (default: a free one).")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="With --elastic: the scheduler's token, read from this file or written there (mode 0600) "
            "if missing (default: a fresh token in the run folder, removed at the end).",
        ),
    ] = None,
    servers: Annotated[
        str | None,
        typer.Option(
            help="Servers of a solved plan: auto (default: leave out any that slows the job), all, or a list: a,b."
        ),
    ] = None,
    known_hosts: KnownHostsOption = None,
    ssh_config: SshConfigOption = None,
    accept_new_host_keys: AcceptNewHostKeysOption = False,
    json_out: JsonOption = False,
) -> None:
    """Train the whole job on this machine: one trainer process per device (or emulated device).

    Without a plan file, given a GBS (--gbs or \\[batching] initial_gbs) and the
    profiles (`jabas profile all`), it trains the solver's plan for that GBS and
    ends with the predicted beside the measured iteration time.

    A rerun continues the job: it resumes from the newest intact checkpoint in
    \\[storage] checkpoint_dir (a corrupt one falls back to the one before) and
    appends to the run folder's metrics; --fresh starts over, moving the old
    folders aside.

    Shows progress (epoch, step, GBS, samples/s, loss), a line per GBS change of
    an adaptive job (\\[batching] metric), and a validation table; metrics also go
    to the run folder as CSV (adjustments.csv for GBS decisions), JSON lines and
    TensorBoard scalars. --json prints the epochs, each with its adjustments.

    On a cluster (servers whose host is another machine) it runs the job as
    --elastic does, starting each server's agent on its host over SSH, checked
    first (docs/cluster.md); each node's output is shown with its name, and
    Ctrl-C ends every process it started on every node.

    Example:

        jabas run -c examples/quickstart.toml

        jabas run -c examples/quickstart.toml --fresh

        jabas run -c examples/two_servers.toml --gbs 256 --servers all

        jabas run -c cluster.toml --known-hosts ~/.ssh/known_hosts
    """
    from jabascli.cli.run_plan import plan_own_run, report_predicted, write_own_plan
    from jabascli.engine.launch import check_plan_inputs, run_local
    from jabascli.engine.rerun import choose_start
    from jabascli.workload import workload_of

    loaded = load_config(config)
    # Every input is checked before anything on disk changes (--fresh moves the job's folders aside).
    from jabascli.elastic.local import remote_servers

    on_cluster = bool(remote_servers(loaded))  # servers on other machines: their agents start over SSH
    on_elastic = elastic or loaded.config.scaling.enabled or on_cluster
    if not on_cluster and (known_hosts is not None or ssh_config is not None or accept_new_host_keys):
        raise InputError.at(None, "--known-hosts", "is used on a cluster only (servers on other machines)")
    solved = None
    if on_elastic:
        from jabascli.cli.elastic import check_elastic_inputs

        # No plan solved here: the scheduler plans each generation itself, the first as below.
        check_elastic_inputs(loaded, servers, plan=plan, gbs=gbs, resume=resume, max_steps=max_steps)
    else:
        if port is not None or token_file is not None:
            raise InputError.at(None, "--port" if port is not None else "--token-file", "is used with --elastic only")
        solved = plan_own_run(loaded, gbs, plan, servers)
        check_plan_inputs(loaded, _training_plan(loaded, solved, plan))
    workload_of(loaded)  # a workload that does not import: one line here, before any trainer starts
    start = choose_start(loaded, resume=resume, fresh=fresh, max_steps=max_steps)
    for note in start.notes:
        err_console.print(note, highlight=False, markup=False)
    if start.done is not None:
        err_console.print(f"nothing to train: {start.done}; --fresh starts over", highlight=False, markup=False)
        return
    if start.resume is not None and resume is None and not json_out:
        where = f"resuming {loaded.config.job.name} from {start.resume} (epoch {start.epoch + 1}, step {start.step})"
        console.print(f"{where}; --fresh starts over", highlight=False, markup=False)
    if on_elastic:
        from jabascli.cli.elastic import run_elastic_here
        from jabascli.elastic.remote import SshOptions

        steer = {"port": port, "token_file": token_file, "servers": servers}
        ssh = SshOptions(known_hosts, ssh_config, accept_new_host_keys)
        run_elastic_here(loaded, json_out, config, resuming=start.resume is not None, ssh=ssh, **steer)
        return
    own = write_own_plan(loaded, solved, quiet=json_out) if solved is not None else None
    plan = own.path if own is not None else plan
    options = TrainOptions(
        plan=plan,
        resume=start.resume,
        checkpoint_every=checkpoint_every,
        max_steps=max_steps,
        bucket_cap_mb=bucket_cap_mb,
    )
    start_shared_server()  # forked from this process while it runs one Python thread: before the display starts one
    try:
        with _RunDisplay(disable=json_out) as display:
            from jabascli.cli.trial import run_with_trial

            def train(o: TrainOptions) -> Any:
                return run_local(loaded, o, on_event=display, max_restarts=max_restarts)

            result, own = run_with_trial(loaded, solved, own, options, start, train, display.notes)
    except KeyboardInterrupt:
        err_console.print(f"interrupted: `{_rerun_command(config)}` resumes from the last checkpoint", markup=False)
        raise typer.Exit(130) from None
    results = result.done["results"]
    if json_out:
        if own is not None:
            report_predicted(loaded, own, display.start, quiet=True)  # the refit, without a line
        for r in results:  # adaptive jobs: each epoch lists its GBS adjustments
            r["adjustments"] = [a for a in display.adjustments if a["epoch"] == r["epoch"]]
        print_json(results)
        return
    start_event = display.start
    title = f"GBS {start_event.get('gbs', '?')} (LBS {start_event.get('lbs', '?')}), {start_event.get('plan', '')}"
    print_results(f"{loaded.config.job.name}: {title}", results)
    if own is not None:
        report_predicted(loaded, own, display.start)


def _training_plan(loaded: LoadedConfig, solved: RunPlan | None, plan_file: Path | None) -> TrainingPlan:
    """The plan the trainers will take: the solver's (not written yet), else the plan file's or the config's."""
    from jabascli.engine.plan import load_plan, plan_from_solver

    if solved is not None:
        return plan_from_solver(solved.plan, "the solver's plan", loaded)
    return load_plan(loaded, plan_file)


def _rerun_command(config: Path) -> str:
    import shlex

    return f"jabas run -c {shlex.quote(str(config))}"


class _RunDisplay:
    """One Rich progress bar for the whole job, fed by rank 0's events."""

    def __init__(self, disable: bool) -> None:
        self.disable = disable
        self.start: dict[str, Any] = {}
        self.adjustments: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.progress = Progress(
            TextColumn("[bold]{task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("step {task.fields[step]}  GBS {task.fields[gbs]}"),
            TextColumn("{task.fields[rate]} samples/s  loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console,
            disable=disable,
            transient=True,
        )
        self.task = self.progress.add_task(
            "train", total=None, epoch="starting trainers", step=0, gbs="-", rate="-", loss="-"
        )

    def __enter__(self) -> _RunDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)  # type: ignore[arg-type]

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            self.start = event
            if not self.disable:
                details = (
                    f"{plural(event['world_size'], 'trainer')} on {event['device']}, "
                    f"GBS {event['gbs']} = LBS {event['lbs']} x {plural(event['workers'], 'worker')} "
                    f"({event['plan']}), "
                    f"weight sync {event['weight_sync']} ({event['weight_sync_reason']}), "
                    f"VSW strategy {event['vsw_strategy']}, precision {event.get('precision', 'fp32')}, "
                    f"loader workers {event.get('loader_workers', 0)}"
                )
                if event.get("layout"):
                    details += f", layout {event['layout']}"
                if event.get("replicas"):
                    details += f", {replicas_line(event['replicas'])}"
                console.print(f"[bold]{escape(event['job'])}[/bold]: {escape(details)}", highlight=False)
                for note in self.notes:
                    console.print(f"  note: {note}", highlight=False, markup=False)
            total = event["steps_per_epoch"]
            self.progress.update(self.task, total=total, completed=event["position"] // event["gbs"])
            self.progress.update(self.task, epoch=f"epoch {event['epoch'] + 1}/{event['epochs']}", gbs=event["gbs"])
        elif kind == "step":
            self.progress.update(
                self.task,
                completed=event["epoch_step"],
                total=event["epoch_steps"],
                epoch=f"epoch {event['epoch'] + 1}/{self.start.get('epochs', '?')}",
                step=event["step"],
                gbs=event["gbs"],
                rate=f"{event['samples_per_s']:.0f}",
                loss=f"{event['loss']:.4f}",
            )
        elif kind == "note":  # before the trainers start: shown with the start line
            self.notes.append(event["message"])
        elif kind == "epoch" and not self.disable:
            self.progress.console.print(epoch_line(event), highlight=False, markup=False)
        elif kind == "adjustment":
            self.adjustments.append(event)
            if not self.disable and (event["changed"] or event["reason"].startswith("keep: no plan")):
                self.progress.console.print(_adjustment_line(event), highlight=False, markup=False)
            if not self.disable and event.get("refit"):
                self.progress.console.print(_refit_line(event), highlight=False, markup=False)

        elif kind == "relayout" and not self.disable:  # the next start line names the new layout
            line = f"step {event['step']}: GBS {event['gbs']} runs under another layout: checkpointed, going on"
            self.progress.console.print(line, highlight=False, markup=False)
        elif kind == "restart":
            where = "its latest checkpoint" if event["resume"] != "None" else "the start"
            line = f"restart {event['restarts']} from {where}: {event['reason']}"
            self.progress.console.print(line, highlight=False, markup=False)


def _refit_line(e: dict[str, Any]) -> str:
    """``step 32: performance model refit to 12 iterations of this plan: measured 7.3 ms, predicted 28.5 ms, now
    20.3 ms; generation 2, runs/job/perfmodel/refit-2.json``."""
    r = e["refit"]
    before = f"predicted {r['predicted_before_s'] * 1e3:.1f} ms, " if r.get("predicted_before_s") else ""
    busy = " (host busy: weighed as the profile)" if r.get("disturbed") else ""
    return (
        f"step {e['step']}: performance model refit to {r['iterations']} iterations of this plan{busy}: measured "
        f"{r['measured_s'] * 1e3:.1f} ms, {before}now {r['predicted_after_s'] * 1e3:.1f} ms; "
        f"generation {r['generation']}, {r['path']}"
    )


def _adjustment_line(e: dict[str, Any]) -> str:
    """``step 40: GBS 80 -> 96 (LBS 16; fast:2GPU,VSW:2,GA:0 ...), similarity 0.031, noise scale 412, LR x1.20``."""
    head = f"step {e['step']}: GBS {e['old_gbs']} -> {e['new_gbs']}"
    if not e["changed"]:
        head = f"step {e['step']}: GBS stays {e['old_gbs']} ({e['reason']})"
    else:
        head += f" (LBS {e['new_lbs']}; {e['plan']})"
    parts = [head]
    if e.get("similarity") is not None:
        parts.append(f"similarity {e['similarity']:.3f}")
    if e.get("noise_scale") is not None:
        parts.append(f"noise scale {e['noise_scale']:.3g}")
    parts.append(f"LR x{e['lr_factor']:.3g}")
    return ", ".join(parts)
