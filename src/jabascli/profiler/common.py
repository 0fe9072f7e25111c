"""What every profiler shares: the device being profiled, progress reporting, output folders.

The library never prints: progress and notes go to a :class:`Reporter`, which
the CLI renders as Rich progress bars. Resolving a target imports no torch; the
measurements themselves run in child processes (:mod:`.child`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.devices import NodeDevices, detect_devices, trainer_threads
from jabascli.errors import InputError
from jabascli.net import is_local
from jabascli.workload import Workload, workload_of

DeviceKind = Literal["cuda", "cpu", "emulated"]


class Reporter:
    """Receives progress from a profiler; the default one ignores it.

    ``progress(completed, total, what)``: ``completed`` of ``total`` units of
    work are done (``total`` None when unknown); ``what`` says what is being
    measured now. ``note(message)``: one finished result worth a line.
    """

    def progress(self, completed: float, total: float | None, what: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass


class ShareReporter(Reporter):
    """A part of a run (a stage, one node's profile) reporting to the whole run's reporter: its progress as its
    ``weight`` of the run's ``total`` after ``before``, its lines under ``prefix`` (once: a line that starts with
    it already is passed on as it is)."""

    def __init__(self, outer: Reporter, before: float, weight: float, total: float, prefix: str) -> None:
        self.outer, self.before, self.weight, self.total, self.prefix = outer, before, weight, total, prefix

    def progress(self, completed: float, total: float | None, what: str) -> None:
        share = min(completed / total, 1.0) if total else 0.0
        self.outer.progress(self.before + self.weight * share, self.total, f"{self.prefix}{what}")

    def note(self, message: str) -> None:
        self.outer.note(message if message.startswith(self.prefix) else f"{self.prefix}{message}")


@dataclass(frozen=True)
class Target:
    """The server this node profiles, and how its device is run and judged."""

    server: ServerConfig
    kind: DeviceKind
    memory_bytes: int
    """Memory budget of one device: the GPU's memory, or the emulated or configured budget."""
    slowdown: float
    """Emulated servers: the profiled trainer is slowed by this, as the engine slows it (1 elsewhere)."""
    threads: int | None
    """torch threads in each measuring process (None: torch's default)."""

    @property
    def device_type(self) -> str:
        return self.server.device_type

    @property
    def device(self) -> str:
        return "cuda" if self.kind == "cuda" else "cpu"

    def describe(self) -> str:
        if self.kind == "emulated":
            return f"{self.device_type} (emulated on the CPU, slowdown x{self.slowdown:g})"
        return f"{self.device_type} ({self.kind})"


def pick_server(loaded: LoadedConfig, name: str | None) -> ServerConfig:
    """``--server NAME``, or the first server of the config."""
    servers = loaded.config.cluster.servers
    if not servers:
        raise InputError.at(loaded.path, "cluster.servers", "no servers: add a [[cluster.servers]] entry for this node")
    if name is None:
        return servers[0]
    for server in servers:
        if server.name == name:
            return server
    known = ", ".join(s.name for s in servers)
    raise InputError.at(loaded.path, "cluster.servers", f"no server named {name!r} (known servers: {known})")


def resolve_target(
    loaded: LoadedConfig,
    server_name: str | None = None,
    threads: int | None = None,
    devices: NodeDevices | None = None,
) -> Target:
    """How this node profiles the chosen server.

    An emulated server runs on the CPU, held to ``emulate.memory_bytes`` and
    slowed by ``emulate.slowdown``. Otherwise a node with an NVIDIA GPU runs on
    it, held to ``memory_bytes`` when the server gives a smaller figure than
    the GPU has; a node without one runs on the CPU, held to ``memory_bytes``
    or else the node's RAM.
    """
    server = pick_server(loaded, server_name)
    if threads is not None and threads < 1:
        raise InputError.at(None, "--threads", f"must be at least 1, got {threads}")
    if server.emulate is not None:
        kind: DeviceKind = "emulated"
        memory = server.emulate.memory_bytes
        slowdown = server.emulate.slowdown
    else:
        found = devices or detect_devices()
        kind = "cuda" if found.backend == "cuda" else "cpu"
        slowdown = 1.0
        memory = found.memory_bytes  # the GPU's memory, or the node's RAM
        if server.memory_bytes is not None and (not memory or server.memory_bytes < memory):
            memory = server.memory_bytes
    if kind != "cuda" and threads is None:
        threads = trainer_threads(trainers_sharing_cores(loaded, server))
    return Target(server, kind, int(memory), float(slowdown), threads)


def trainers_sharing_cores(loaded: LoadedConfig, server: ServerConfig) -> int:
    """How many trainer processes will share this machine's cores with each of ``server``'s.

    When every server of the job is on this machine, ``jabas run`` starts them
    all here (one trainer per device of every available server); otherwise the
    server is a node of its own, whose trainers are one per device.
    """
    servers = loaded.config.available() or [server]
    if all(is_local(s.host) for s in servers):
        return sum(s.devices for s in servers)
    return server.devices


def ensure_writable(folder: Path) -> Path:
    """Create ``folder`` and check a file can be written in it, before measuring anything."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".jabas-write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError.at(folder, None, f"output folder is not writable: {reason}") from None
    return folder


def positive(value: int | float, option: str) -> None:
    if value <= 0:
        raise InputError.at(None, option, f"must be positive, got {value}")


def measured_with(precision: str, threads: int | None, device: str | None = None) -> dict[str, Any]:
    """What a profile records about how it was measured: precision, torch version, threads, device."""
    import torch

    return {
        "precision": precision,
        "torch_version": torch.__version__,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "device": device,
    }


def check_reusable(path: Path, measured: str | None, precision: str) -> None:
    """A profile on disk is reused only when measured in the job's precision (unknown: a seed file, reused)."""
    if measured is not None and measured != precision:
        raise InputError.at(
            path,
            "precision",
            f"was measured in {measured}, but [job] precision is {precision}: measure again with --force, "
            "or write to another --out",
        )


def job_workload(loaded: LoadedConfig) -> tuple[Workload, dict[str, Any]]:
    """The job's workload, checked in this process, and how a child process loads it again."""
    job = loaded.config.job
    workload = workload_of(loaded)
    spec = {
        "workload": str(workload.path),
        "options": job.options,
        "data": str(job.data) if job.data else None,
        "precision": job.precision,
        "clip_grad_norm": job.clip_grad_norm,
    }
    return workload, spec


def servers_here(loaded: LoadedConfig) -> tuple[list[ServerConfig], list[ServerConfig]]:
    """The job's servers on this machine, and those elsewhere."""
    servers = loaded.config.available()
    return [s for s in servers if is_local(s.host)], [s for s in servers if not is_local(s.host)]
