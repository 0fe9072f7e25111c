"""The job as a Slurm batch script (``jabas slurm submit``): one heterogeneous component per device type.

The script runs the scheduler on the allocation's first node and one ``jabas worker --slurm`` per node
through ``srun``; what each of them does inside the allocation is :mod:`jabascli.elastic.slurm`'s.
docs/slurm.md explains each line of the script.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError, Problem, RuntimeFailure

SBATCH_TIMEOUT_S = 30.0

_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[^\s#'\"\\]+)?")
_WORD = re.compile(r"[A-Za-z0-9_.:+-]+")


@dataclass(frozen=True)
class Component:
    """One heterogeneous component: the servers of one device type."""

    device_type: str
    servers: list[str]
    devices: int
    """Devices per node (the most of its servers')."""

    def options(self, loaded: LoadedConfig) -> list[str]:
        cfg = loaded.config.slurm
        found = [f"--nodes={len(self.servers)}", "--ntasks-per-node=1", "--exclusive"]
        if cfg.select == "gres":
            found.append(f"--gres=gpu:{self.device_type}:{self.devices}")
        else:
            found.append(f"--constraint={self.device_type}")
        if cfg.partition:
            found.append(f"--partition={cfg.partition}")
        if cfg.account:
            found.append(f"--account={cfg.account}")
        if cfg.time:
            found.append(f"--time={cfg.time}")
        return found + list(cfg.options)


def components(loaded: LoadedConfig) -> list[Component]:
    """The job's servers (``available_servers``, else all) grouped by device type, in the order each type first
    appears; InputError for a device type or ``[slurm] options`` entry that cannot go into ``#SBATCH`` lines."""
    groups: dict[str, list[str]] = {}
    devices: dict[str, int] = {}
    problems: list[tuple[str, str]] = []
    for server in loaded.config.available():
        if not _WORD.fullmatch(server.device_type):
            problems.append(
                ("cluster.servers", f"{server.name}: device_type {server.device_type!r} is no Slurm feature")
            )
        groups.setdefault(server.device_type, []).append(server.name)
        devices[server.device_type] = max(devices.get(server.device_type, 0), server.devices)
    for option in loaded.config.slurm.options:
        if not _OPTION.fullmatch(option):
            problems.append(("slurm.options", f"{option!r} is not --name or --name=value (no spaces or quotes)"))
    if not groups:
        problems.append(("cluster.servers", "no servers: the job needs at least one [[cluster.servers]] entry"))
    if problems:
        raise InputError([Problem(loaded.path, where, message) for where, message in problems])
    return [Component(kind, names, devices[kind]) for kind, names in groups.items()]


def script_path(loaded: LoadedConfig) -> Path:
    """Where ``jabas slurm submit`` writes the job's batch script."""
    return run_folder(loaded) / "slurm" / f"{loaded.config.job.name}.sbatch"


def batch_script(loaded: LoadedConfig, python: str) -> str:
    """The sbatch script of the job: one heterogeneous component per device type; on the first node the scheduler,
    on every node one ``jabas worker --slurm`` (docs/slurm.md explains each line)."""
    parts = components(loaded)
    folder = run_folder(loaded) / "slurm"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", loaded.config.job.name)
    output = f"{folder}/slurm-%j.out"
    if any(char in output for char in '"\n\r\t'):
        raise InputError.at(loaded.path, "storage.run_dir", f"{folder}: an #SBATCH line cannot hold this folder's name")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=jabas-{name}",
        f'#SBATCH --output="{output}"' if " " in output else f"#SBATCH --output={output}",
    ]
    for i, part in enumerate(parts):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append("#SBATCH " + " ".join(part.options(loaded)))
    config = shlex.quote(str(loaded.path))
    jabas = " ".join(shlex.quote(word) for word in (python, "-m", "jabascli"))
    groups = ",".join(str(i) for i in range(len(parts)))
    het = f" --het-group={groups}" if len(parts) > 1 else ""
    lines += [
        "#",
        f"# jabas job {loaded.config.job.name!r}, written by `jabas slurm submit -c {_printable(config)}`;",
        "# submit it again with `sbatch` and this file: a job that has a checkpoint continues from it.",
        *(
            f"# Component {i}: {part.device_type}, servers {_printable(', '.join(part.servers))}."
            for i, part in enumerate(parts)
        ),
        "set -u",
        f"jabas=({jabas})",
        f"config={config}",
        f"folder={shlex.quote(str(folder))}/$SLURM_JOB_ID",
        "# The scheduler's token: a fresh one, mode 0600, in this job's folder (never on a command line).",
        'mkdir -p "$folder" && "${jabas[@]}" token "$folder/token" >/dev/null || exit 1',
        "# scancel sends SIGTERM to every process of the job: the scheduler then stops the job at the next",
        "# iteration (the trainers write a checkpoint and exit), and this script waits for it.",
        "trap 'echo \"jabas: SIGTERM, the job stops at the next iteration with a checkpoint\"' TERM",
        "# The scheduler, on this node (the first node of component 0).",
        '"${jabas[@]}" slurm schedule -c "$config" &',
        "scheduler=$!",
        "# One worker agent on every node of every component; each finds its server from Slurm's environment.",
        "# --no-kill: a node lost or given back ends its worker only; the scheduler carries on without it.",
        f'srun{het} --ntasks-per-node=1 --no-kill "${{jabas[@]}}" worker -c "$config" --slurm &',
        "workers=$!",
        "# wait returns early when the trap above runs: wait again until the process has ended.",
        'while kill -0 "$scheduler" 2>/dev/null; do wait "$scheduler"; done',
        'wait "$scheduler"',
        "code=$?",
        'while kill -0 "$workers" 2>/dev/null; do wait "$workers"; done',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def _printable(text: str) -> str:
    """``text`` for a comment line of the script: what is not printable (a line break) becomes '?'."""
    return "".join(char if char.isprintable() else "?" for char in text)


def submit(script: Path, environ: Mapping[str, str] | None = None) -> str:
    """``sbatch --parsable SCRIPT`` (an argument list, no shell); the job id. RuntimeFailure with sbatch's message."""
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env=dict(os.environ if environ is None else environ),
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise RuntimeFailure.at(None, None, "sbatch not found: is this a Slurm login node?") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailure.at(None, None, f"sbatch: {exc}") from None
    if result.returncode != 0:
        message = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
        raise RuntimeFailure.at(script, None, f"sbatch refused it: {message}")
    return result.stdout.strip().split(";")[0]
