"""``jabas init``: write a starting jabas.toml for this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.atomic import atomic_write_text
from jabascli.cli.common import cli_command, console
from jabascli.config.template import render_starting_config, starting_devices
from jabascli.devices import detect_devices
from jabascli.errors import InputError, Problem
from jabascli.workload import builtin_workloads, resolve_workload_path


@cli_command
def init(
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the config.")] = Path("jabas.toml"),
    workload: Annotated[
        str, typer.Option(help=f"A built-in workload ({', '.join(builtin_workloads())}) or a workload .py file.")
    ] = "digits",
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented jabas.toml for this machine, with its devices detected.

    On a machine without GPUs the server gets two devices: each stands for one
    trainer process on the CPU. Every key is explained in jabas.toml.example.

    Example:

        jabas init --workload digits && jabas run -c jabas.toml
    """
    if out.exists() and not force:
        raise InputError.at(out, None, "already exists; pass --force to overwrite it")
    try:
        resolve_workload_path(workload)  # a built-in name or a workload file: checked before writing
    except InputError as exc:
        raise InputError([Problem(None, "--workload", p.message) for p in exc.problems]) from None
    devices = detect_devices()
    atomic_write_text(out, render_starting_config(devices, workload))
    count = starting_devices(devices)
    if devices.backend == "cpu":
        what = f"{count} trainer processes on the CPU (no GPU found; each stands for a device)"
    else:
        what = f"{count} x {devices.device_type} ({devices.source})"
    console.print(f"wrote {out} for {what}", highlight=False)
