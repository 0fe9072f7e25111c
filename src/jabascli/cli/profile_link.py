"""``jabas profile link``: the link between two nodes, written into the job's hybrid profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from jabascli.cli.common import ConfigOption, JsonOption, cli_command, console, print_json
from jabascli.cli.profile_options import LaunchedOption
from jabascli.cli.profile_progress import emit, launched_errors, launched_reporting, reporting
from jabascli.config import load_config


@cli_command
def link(
    config: ConfigOption,
    rank: Annotated[
        int, typer.Option(help="0 on the node at --master's address (it writes the profile), 1 on the other.")
    ],
    master: Annotated[str, typer.Option(help="ADDR:PORT where rank 0's node listens, e.g. 10.0.0.5:29520.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Profiles folder holding hybrid/network.json (default: the config's)."),
    ] = None,
    max_kib: Annotated[
        int, typer.Option(help="Largest message in KiB: 1 KiB, 4 KiB, ... up to it (a slow link takes long).")
    ] = 4096,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the other node and measure, before giving up.")
    ] = 600.0,
    json_out: JsonOption = False,
    launched: LaunchedOption = False,
) -> None:
    """The link between two nodes, as the hybrid planner prices what crosses between servers.

    Run it on both nodes at once, rank 0 on the node whose address is in
    --master: all-reduce, all-gather, reduce-scatter and send by size (gloo)
    cross the link. Rank 0 then replaces the `inter` link of
    <profiles>/hybrid/network.json (which `jabas profile hybrid -c CONFIG`
    wrote on one machine, over loopback) by what it measured, with both
    nodes' addresses. `jabas profile all` on a cluster runs both sides itself,
    between its first two servers' nodes.

    Example (on node 10.0.0.5, then on the other node):

        jabas profile link -c jabas.toml --rank 0 --master 10.0.0.5:29520

        jabas profile link -c jabas.toml --rank 1 --master 10.0.0.5:29520
    """
    from jabascli.profiler.link import profile_link

    with launched_errors(launched):
        loaded = load_config(config, check_profiles=False)
        shown = launched_reporting() if launched else reporting("Link profile", json_out)
        with shown as reporter:
            run = profile_link(loaded, rank, master, out=out, max_kib=max_kib, timeout_s=timeout, reporter=reporter)
    path = str(run.path) if run.path is not None else None
    if launched:
        from jabascli.profiler.events import event_line

        emit(event_line("result", path=path, hosts=run.hosts, sizes=run.sizes, gbps=run.gbps))
        return
    if json_out:
        rows = [r.model_dump(mode="json") for r in run.rows]
        print_json({"rank": rank, "path": path, "hosts": run.hosts, "gbps": run.gbps, "rows": rows})
        return
    between = " and ".join(run.hosts)
    console.print(
        f"link between {between}: {run.sizes} sizes, all-reduce {run.gbps:.3g} GB/s at the largest", highlight=False
    )
    if run.path is not None:
        console.print(f"written to {escape(path or '')} (its inter link)", highlight=False)
    else:
        console.print("rank 0 writes the profile", highlight=False)
