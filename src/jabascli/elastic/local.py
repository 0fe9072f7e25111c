"""The whole elastic runtime on one machine (``jabas run --elastic``): a scheduler and an agent per server.

Each configured server gets its own ``jabas worker`` process and the
scheduler its own ``jabas schedule`` process, all on loopback, sharing a token
handed over in their environment. Emulated servers (``emulate = {...}``) make a
laptop stand for a cluster of unequal GPUs; ``jabas job move|status|stop``
steer the job as on real nodes: while it runs, the run folder holds
``scheduler.json`` (the scheduler's address and token file) and the token file
``scheduler.token`` (both mode 0600), which ``jabas job ... -c CONFIG`` finds
from the config alone (:func:`find_steering`); both go when the run ends.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jabascli.atomic import atomic_write
from jabascli.children import PREEXEC
from jabascli.config import LoadedConfig
from jabascli.devices import trainer_threads
from jabascli.elastic.client import SchedulerClient, Unreachable
from jabascli.elastic.job import TERMINAL
from jabascli.elastic.protocol import JobStatus
from jabascli.elastic.token import TOKEN_ENV, read_token_file, write_token
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError, RuntimeFailure
from jabascli.net import free_port, is_local, local_address_towards

if TYPE_CHECKING:
    from jabascli.elastic.remote import Node, RemoteAgent, SshOptions

POLL_S = 0.25
START_TIMEOUT_S = 60.0
STEERING = "scheduler.json"
TOKEN_FILE = "scheduler.token"


@dataclass(frozen=True)
class Steering:
    """Where a running ``jabas run --elastic`` can be steered from: its scheduler and token file."""

    address: str
    token_file: Path

    def write(self, folder: Path) -> Path:
        data = json.dumps({"address": self.address, "token_file": str(self.token_file)}).encode()
        return atomic_write(folder / STEERING, lambda f: f.write(data), mode=0o600)


def find_steering(loaded: LoadedConfig) -> Steering | None:
    """The steering file of this job's ``jabas run --elastic``, while it runs (None when there is none)."""
    path = run_folder(loaded) / STEERING
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return Steering(str(record["address"]), Path(record["token_file"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError.at(path, None, f"not a readable steering file: {exc}") from None


def run_token(loaded: LoadedConfig, token_file: Path | None) -> tuple[str, Path]:
    """The token of a ``jabas run --elastic`` and its file: ``token_file``'s (made if missing), else a fresh one
    in the run folder."""
    if token_file is not None and token_file.exists():
        return read_token_file(token_file), token_file
    path = token_file or run_folder(loaded) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_token(path), path


def remote_servers(loaded: LoadedConfig) -> list[int]:
    """The indexes of the servers whose ``host`` is not this machine: their agents start over SSH."""
    return [i for i, server in enumerate(loaded.config.cluster.servers) if not is_local(server.host)]


def run_elastic(
    loaded: LoadedConfig,
    on_status: Callable[[JobStatus], None] | None = None,
    port: int | None = None,
    resume: bool = False,
    token_file: Path | None = None,
    on_steering: Callable[[Steering], None] | None = None,
    ssh: SshOptions | None = None,
    on_line: Callable[[str, str], None] | None = None,
    servers: str | None = None,
) -> JobStatus:
    """Run the job under a scheduler here and one agent per server until it is over; its last status.

    The agent of a server on this machine is a child process; that of a server on another machine
    is started there over SSH (:mod:`jabascli.elastic.remote`, ``ssh``: how to connect), every node
    checked before anything starts, and each line it prints goes to ``on_line(server, line)``.
    ``resume``: continue from the job's newest checkpoint (``jabas schedule --resume``).
    ``token_file``: the token's file (default: a fresh token in the run folder); ``on_steering``:
    called with the scheduler's address and token file once they are written; ``servers``: those of the first
    plan (``jabas schedule --servers``).
    """
    remote = remote_servers(loaded)
    address = scheduler_address(loaded, remote)
    nodes: list[Node] = []
    if remote:
        from jabascli.elastic.remote import SshOptions, connect_nodes

        nodes = connect_nodes(loaded, remote, ssh or SshOptions())
    token, token_path = run_token(loaded, token_file)
    port = port or free_port(address)
    scheduler = f"{address}:{port}"
    env = agent_environment(loaded, token, os.environ)
    logs = run_folder(loaded) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    jabas = [sys.executable, "-m", "jabascli"]
    config = str(loaded.path)
    commands = {"scheduler": [*jabas, "schedule", "-c", config, "--address", address, "--port", str(port)]}
    if not remote:
        commands["scheduler"].append("--loopback-trainers")
    if resume:
        commands["scheduler"].append("--resume")
    if servers is not None:
        commands["scheduler"] += ["--servers", servers]
    for rank, server in enumerate(loaded.config.cluster.servers):
        if rank not in remote:
            commands[f"worker-{server.name}"] = [
                *jabas, "worker", "-c", config, "--rank", str(rank), "--scheduler", scheduler
            ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes] | RemoteAgent] = {}
    steering = Steering(scheduler, token_path)
    steering_file = steering.write(run_folder(loaded))
    try:
        if on_steering is not None:
            on_steering(steering)
        for name, command in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                # Ctrl-C reaches this process alone, which stops the job in order (the trainers checkpoint);
                # should it die, so do its children.
                procs[name] = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    preexec_fn=PREEXEC,
                )
        if nodes:
            procs.update(_start_remote(loaded, nodes, scheduler, token, logs, on_line))
        with SchedulerClient(steering.address, token) as client:
            status = _follow(client, procs, on_status)
        _end(procs, grace_s=30.0)
        return status
    except BaseException:
        with contextlib.suppress(Exception), SchedulerClient(steering.address, token, timeout_s=2) as client:
            client.stop("now")  # the trainers checkpoint, the scheduler and agents end
        _end(procs)
        raise
    finally:
        for node in nodes:
            node.client.close()
        steering_file.unlink(missing_ok=True)
        if token_file is None:
            token_path.unlink(missing_ok=True)  # made for this run only


def scheduler_address(loaded: LoadedConfig, remote: list[int]) -> str:
    """Where the scheduler listens: loopback when every agent runs here, else ``[scheduler] address``, or
    when it is not set, this machine's address towards the first remote server (never every interface)."""
    if not remote:
        return "127.0.0.1"
    cfg, servers = loaded.config.scheduler, loaded.config.cluster.servers
    first = servers[remote[0]]
    for server in servers:
        if is_local(server.host) and ipaddress.ip_address(_resolved(server.host)).is_loopback:
            raise InputError.at(
                loaded.path,
                f"cluster.servers.{server.name}.host",
                f"{server.host} cannot be reached from server {first.name!r} ({first.host}): give this machine's "
                "address on the cluster network",
            )
    if "address" in cfg.model_fields_set:
        if ipaddress.ip_address(_resolved(cfg.address)).is_loopback:
            raise InputError.at(
                loaded.path,
                "scheduler.address",
                f"{cfg.address} cannot be reached from server {first.name!r} ({first.host}): give this machine's "
                "address on the cluster network, or leave it out",
            )
        return cfg.address
    towards = local_address_towards(first.host)
    if towards is None:
        raise RuntimeFailure.at(None, None, f"no route from this machine to server {first.name!r} ({first.host})")
    return towards


def _resolved(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host


def _start_remote(
    loaded: LoadedConfig,
    nodes: list[Node],
    scheduler: str,
    token: str,
    logs: Path,
    on_line: Callable[[str, str], None] | None,
) -> dict[str, RemoteAgent]:
    """Each node's agent, its lines written to ``logs/worker-NAME.log`` and handed to ``on_line``."""
    from jabascli.elastic.lifeline import LaunchOrder, passed_on
    from jabascli.elastic.remote import RemoteAgent, worker_argv

    order = LaunchOrder(token=token, env=passed_on(dict(os.environ), TOKEN_ENV))

    def line(server: str, text: str) -> None:
        with (logs / f"worker-{server}.log").open("a", encoding="utf-8") as log:  # agents print a few lines
            log.write(text + "\n")
        if on_line is not None:
            on_line(server, text)

    return {
        f"worker-{node.server.name}": RemoteAgent.start(node, worker_argv(loaded, node, scheduler), order, line)
        for node in nodes
    }


def agent_environment(loaded: LoadedConfig, token: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The scheduler's and agents' environment: the token, and each trainer's share of this machine's cores.

    Every server's trainers run on this one machine, so its cores are shared among all of them, as
    `jabas run` shares them (``OMP_NUM_THREADS``, unless set). An agent alone would give its own
    trainers every core, as on a node of its own; oversubscribed OpenMP threads then stall for
    scheduler quanta (a digits forward of 40-100 ms instead of 1 ms, with two servers on two cores).
    """
    trainers = sum(server.devices for server in loaded.config.cluster.servers)
    threads = trainer_threads(trainers, environ)
    return {**environ, TOKEN_ENV: token, "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS", str(threads))}


def _follow(
    client: SchedulerClient,
    procs: Mapping[str, subprocess.Popen[bytes] | RemoteAgent],
    on_status: Callable[[JobStatus], None] | None,
) -> JobStatus:
    started = time.monotonic()
    status: JobStatus | None = None
    while True:
        try:
            status = client.status()
        except Unreachable:
            if procs["scheduler"].poll() is not None:
                if status is not None and status.state in TERMINAL:
                    return status
                raise RuntimeFailure.at(
                    None, None, f"the scheduler exited with code {procs['scheduler'].returncode} (see its log)"
                ) from None
            if status is None and time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeFailure.at(None, None, "the scheduler did not start") from None
        else:
            if on_status is not None:
                on_status(status)
            if status.state in TERMINAL:
                return status
        dead = [n for n, p in procs.items() if n != "scheduler" and p.poll() not in (None, 0)]
        if dead and status is not None and status.state == "waiting":
            raise RuntimeFailure.at(None, None, f"{dead[0]} exited with code {procs[dead[0]].returncode}")
        time.sleep(POLL_S)


def _end(procs: Mapping[str, subprocess.Popen[bytes] | RemoteAgent], grace_s: float = 10.0) -> None:
    """Wait for every process to exit, at most ``grace_s`` in all; kill what is left (remote agents: by
    closing their standard input, then by pid)."""
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        left = max(deadline - time.monotonic(), 0.1)
        if not isinstance(proc, subprocess.Popen):
            proc.end(left)
            continue
        try:
            proc.wait(left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
