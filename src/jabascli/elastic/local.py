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
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jabascli.atomic import atomic_write
from jabascli.config import LoadedConfig
from jabascli.devices import trainer_threads
from jabascli.elastic.client import SchedulerClient, Unreachable
from jabascli.elastic.job import TERMINAL
from jabascli.elastic.protocol import JobStatus
from jabascli.elastic.token import TOKEN_ENV, read_token_file, write_token
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError, RuntimeFailure
from jabascli.net import free_port

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


def run_elastic(
    loaded: LoadedConfig,
    on_status: Callable[[JobStatus], None] | None = None,
    port: int | None = None,
    resume: bool = False,
    token_file: Path | None = None,
    on_steering: Callable[[Steering], None] | None = None,
) -> JobStatus:
    """Run the job under a local scheduler and one agent per server until it is over; its last status.

    ``resume``: continue from the job's newest checkpoint (``jabas schedule --resume``).
    ``token_file``: the token's file (default: a fresh token in the run folder); ``on_steering``:
    called with the scheduler's address and token file once they are written.
    """
    token, token_path = run_token(loaded, token_file)
    port = port or free_port()
    env = agent_environment(loaded, token, os.environ)
    logs = run_folder(loaded) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    jabas = [sys.executable, "-m", "jabascli"]
    config = str(loaded.path)
    commands = {"scheduler": [*jabas, "schedule", "-c", config, "--port", str(port), "--loopback-trainers"]}
    if resume:
        commands["scheduler"].append("--resume")
    for rank, server in enumerate(loaded.config.cluster.servers):
        commands[f"worker-{server.name}"] = [
            *jabas, "worker", "-c", config, "--rank", str(rank), "--scheduler", f"127.0.0.1:{port}"
        ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    steering = Steering(f"127.0.0.1:{port}", token_path)
    steering_file = steering.write(run_folder(loaded))
    try:
        if on_steering is not None:
            on_steering(steering)
        for name, command in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        with SchedulerClient(steering.address, token) as client:
            status = _follow(client, procs, on_status)
        for proc in procs.values():
            proc.wait(30)
        return status
    except BaseException:
        with contextlib.suppress(Exception), SchedulerClient(steering.address, token, timeout_s=2) as client:
            client.stop("now")  # the trainers checkpoint, the scheduler and agents end
        _end(procs)
        raise
    finally:
        steering_file.unlink(missing_ok=True)
        if token_file is None:
            token_path.unlink(missing_ok=True)  # made for this run only


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
    procs: dict[str, subprocess.Popen[bytes]],
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


def _end(procs: dict[str, subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
