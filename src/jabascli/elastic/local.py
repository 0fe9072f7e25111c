"""The whole elastic runtime on one machine (``jabas run --elastic``): a scheduler and an agent per server.

Each configured server gets its own ``jabas worker`` process and the
scheduler its own ``jabas schedule`` process, all on loopback, sharing a token
generated for this run and handed over in their environment (it is never
written to disk). Emulated servers (``emulate = {...}``) make a laptop stand
for a cluster of unequal GPUs; ``jabas job move|status|stop`` steer the job as on
real nodes (they need the token: it is printed nowhere, so use ``--port`` and
``JABAS_TOKEN`` to choose them when steering by hand).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from jabascli.config import LoadedConfig
from jabascli.devices import trainer_threads
from jabascli.elastic.client import SchedulerClient, Unreachable
from jabascli.elastic.job import TERMINAL
from jabascli.elastic.protocol import JobStatus
from jabascli.elastic.token import TOKEN_ENV, new_token
from jabascli.engine.layout import run_folder
from jabascli.errors import RuntimeFailure
from jabascli.net import free_port

POLL_S = 0.25
START_TIMEOUT_S = 60.0


def run_elastic(
    loaded: LoadedConfig,
    on_status: Callable[[JobStatus], None] | None = None,
    token: str | None = None,
    port: int | None = None,
    resume: bool = False,
) -> JobStatus:
    """Run the job under a local scheduler and one agent per server until it is over; its last status.

    ``resume``: continue from the job's newest checkpoint (``jabas schedule --resume``).
    """
    token = token or new_token()
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
    try:
        for name, command in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        with SchedulerClient(f"127.0.0.1:{port}", token) as client:
            status = _follow(client, procs, on_status)
        for proc in procs.values():
            proc.wait(30)
        return status
    except BaseException:
        with contextlib.suppress(Exception), SchedulerClient(f"127.0.0.1:{port}", token, timeout_s=2) as client:
            client.stop("now")  # the trainers checkpoint, the scheduler and agents end
        _end(procs)
        raise


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
