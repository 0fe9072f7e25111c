"""``jabas cluster``: describe this node's devices."""

from __future__ import annotations

from typing import Annotated

import tomli_w
import typer

from jabascli.cli.common import JsonOption, cli_command, console, print_json
from jabascli.devices import detect_devices

app = typer.Typer(help="Inspect the cluster's devices.", no_args_is_help=True)


@app.command()
@cli_command
def detect(
    name: Annotated[str | None, typer.Option(help="Server name for the entry (default: host name).")] = None,
    host: Annotated[str, typer.Option(help="Address other nodes reach this one at.")] = "127.0.0.1",
    json_out: JsonOption = False,
) -> None:
    """Print this node's devices as a cluster-info entry.

    GPUs are found through NVML (nvidia-ml-py), else torch.cuda; a machine
    without GPUs is one device of type "cpu". Paste the TOML into the
    [[cluster.servers]] list of jabas.toml.

    Example:

        jabas cluster detect --name node0 --host 10.0.0.5 >> jabas.toml
    """
    devices = detect_devices()
    entry = devices.server_entry(name, host)
    if json_out:
        print_json({**entry, "backend": devices.backend, "source": devices.source})
        return
    console.print(f"# found by {devices.source}", highlight=False)
    console.print(tomli_w.dumps({"cluster": {"servers": [entry]}}).strip(), highlight=False, markup=False)
