"""``jabas profile hybrid`` and ``jabas profile import``: the hybrid planner's profiles, measured or converted."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, print_json
from jabascli.cli.profile_options import ForceOption
from jabascli.cli.profile_progress import reporting
from jabascli.config import load_config
from jabascli.errors import InputError
from jabascli.profiler.child import prepare_forked_children


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
    prepare_forked_children()
    with reporting("Hybrid profiles", json_out) as reporter:
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
