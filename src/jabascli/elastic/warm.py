"""A node's warm trainer server: the worker agent forks its trainers from it (docs/elastic.md).

One :class:`~jabascli.forkserver.ForkServer` per node whose last preload is
:mod:`jabascli.cli.spare`'s warm-up: torch, jabas and the job's workload
imported, a model and optimizer built once, and on a CPU node the datasets
loaded and one backward run. It is started when the agent registers and kept
for the job, so that no trainer of any generation waits for a new interpreter to
import torch. Should it die, it is started again :data:`WARM_DELAY_S` after the
last generation's start (not to slow that start); once it failed to start (no
fork here, or its imports failed) never again, and trainers start fresh.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from jabascli.children import Child
from jabascli.config import LoadedConfig
from jabascli.engine.events import EVENT_FD_ENV
from jabascli.engine.trainer_env import TRAINER_ENTRY, WARM_CONFIG_ENV, WARM_CPU_ENV, WARM_UP
from jabascli.forkserver import TRAINER_PRELOAD, ForkServer, Unavailable

WARM_DELAY_S = 5.0
"""A warm server that died is started again this long after a generation's start, not to slow it."""


class WarmServer:
    """This node's warm trainer server, kept for the job; :meth:`fork` a trainer from it once it is ready."""

    server: ForkServer | None
    """The running server, once started (:meth:`keep`)."""
    failed: bool
    """It could not start (no fork here, or its imports failed): trainers start fresh."""
    cpu: bool
    """Trainers here compute on the CPU: the server also warms the data and the CPU kernels."""
    last_start: float
    """When the agent last started a generation (its clock)."""

    def __init__(
        self, loaded: LoadedConfig, rank: int, environment: Mapping[str, str], clock: Callable[[], float]
    ) -> None:
        self.loaded, self.rank, self.environment, self.clock = loaded, rank, dict(environment), clock
        self.server, self.failed, self.cpu = None, False, False
        self.last_start = -WARM_DELAY_S

    def keep(self) -> None:
        """Start the server if there is none (but not within :data:`WARM_DELAY_S` of a generation's start),
        take in a failed start, and drop one that died."""
        if self.server is not None and not self.server.alive():
            self.close()
        if self.server is not None:
            self.ready()  # takes in a failed start
            return
        if self.failed or self.clock() - self.last_start < WARM_DELAY_S:
            return
        env = {**self.environment, WARM_CONFIG_ENV: str(self.loaded.path)}
        if self.cpu or self.loaded.config.cluster.servers[self.rank].emulate is not None:
            env[WARM_CPU_ENV] = "1"
        try:
            self.server = ForkServer((*TRAINER_PRELOAD, WARM_UP), env=env)
        except Unavailable:
            self.failed = True

    def ready(self) -> bool:
        """Whether the server has done its imports and warm-up, without waiting for it."""
        if self.server is None:
            return False
        try:
            return self.server.ready(0)
        except Unavailable:
            self.server, self.failed = None, True
            return False

    def importing(self) -> bool:
        """The server is started and not ready yet: a trainer started fresh now would import beside it."""
        return self.server is not None and not self.ready()

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> tuple[Child, int] | None:
        """A trainer forked by the server, in its own session and killed with it (so with the agent), and the
        read end of its event pipe; None while the server is not ready (the trainer then starts fresh)."""
        if not self.ready():
            return None
        assert self.server is not None
        read_fd, write_fd = os.pipe()
        env = {**env, EVENT_FD_ENV: str(write_fd)}
        try:
            with log.open("wb") as out:
                proc = self.server.spawn(
                    TRAINER_ENTRY, argv, env, out.fileno(), (write_fd,), new_session=True, name="jabas-train"
                )
        except Unavailable:  # the server is gone: this trainer and the next start fresh, until it is back
            os.close(read_fd)
            self.close()
            return None
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return proc, read_fd

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
