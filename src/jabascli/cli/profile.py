"""``jabas profile``: measure memory, computation, buckets and communication."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, not_implemented

app = typer.Typer(help="Measure what the solver needs, per device type.", no_args_is_help=True)

OutOption = Annotated[
    Path | None, typer.Option("--out", help="Output folder (default: the folder named in the config's [profiles]).")
]
ServerOption = Annotated[
    str | None, typer.Option("--server", help="This node's server name in the config (default: the first server).")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Measure again what is already on disk.")]


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
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Memory profile: the largest VSW count that fits, per local batch size.

    Writes <out>/<LBS>/<server>/max_memory_profile_info.json.

    Example:

        jabas profile mem -c jabas.toml --lbs 16 --search dynamic
    """
    not_implemented("profile mem", 4)


@app.command()
@cli_command
def comp(
    config: ConfigOption,
    out: OutOption = None,
    server: ServerOption = None,
    warmup: Annotated[int, typer.Option(help="Warm-up iterations before measuring.")] = 5,
    iters: Annotated[int, typer.Option(help="Measured iterations per configuration.")] = 20,
    cooldown: Annotated[float | None, typer.Option(help="Seconds to pause between runs (default 0 on CPU).")] = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Computation profile: data, forward, backward, update, copy time per (LBS, VSW).

    Writes <out>/<LBS>/<server>/<server>_<model>_<LBS>_<VSW>_comp_profile.json.

    Example:

        jabas profile comp -c jabas.toml --iters 30
    """
    not_implemented("profile comp", 4)


@app.command()
@cli_command
def bucket(
    config: ConfigOption,
    out: OutOption = None,
    bucket_cap_mb: Annotated[float, typer.Option(help="DDP bucket cap in MB.")] = 25.0,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """Gradient bucket sizes (MB) that DDP forms for the model, in gradient-ready order.

    Writes <out>/<model>_bucket_size_profile.json.

    Example:

        jabas profile bucket -c examples/resnet50.toml
    """
    not_implemented("profile bucket", 4)


@app.command()
@cli_command
def comm(
    config: ConfigOption,
    out: OutOption = None,
    sizes: Annotated[str, typer.Option(help="Message sizes in MB: LO:HI (doubling) or a comma list.")] = "1:150",
    nprocs: Annotated[int, typer.Option(help="Local processes (intra-node profile).")] = 2,
    rank: Annotated[int | None, typer.Option(help="This node's rank (inter-node profile).")] = None,
    world: Annotated[int | None, typer.Option(help="Number of nodes (inter-node profile).")] = None,
    master: Annotated[str | None, typer.Option(help="ADDR:PORT of rank 0 (inter-node profile).")] = None,
    force: ForceOption = False,
    json_out: JsonOption = False,
) -> None:
    """All-reduce time per message size, intra-node (and inter-node with --rank/--world/--master).

    Writes ideal_ms,measured_ms lines to intra_comm_profile_data.txt or inter_comm_profile_data.txt.

    Example:

        jabas profile comm -c jabas.toml --nprocs 2

        jabas profile comm -c jabas.toml --rank 0 --world 2 --master 10.0.0.5:29500
    """
    not_implemented("profile comm", 4)


@app.command()
@cli_command
def summary(
    folder: Annotated[Path, typer.Argument(help="A profile folder (or the memory/computation folder).")],
    json_out: JsonOption = False,
) -> None:
    """Print the memory and computation profiles as a table (LBS x device type).

    Example:

        jabas profile summary profiles/
    """
    not_implemented("profile summary", 4)
