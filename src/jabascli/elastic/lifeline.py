"""An agent started by a launcher lives only as long as the launcher's connection to it.

``jabas run`` on a cluster starts each node's ``jabas worker --stdin`` over SSH
(:mod:`jabascli.elastic.remote`). The launcher writes one line of JSON on the
agent's standard input, :class:`LaunchOrder`: the scheduler's token (so it is
never on a command line or in a file on the node) and the few environment
variables the launcher passes on. Then it keeps standard input open. When it
closes (the launcher ended the job, pressed Ctrl-C, crashed, or its machine or
link went away and SSH dropped the session), the agent reads end-of-file and
ends itself as SIGTERM would: its trainers get SIGTERM, then SIGKILL, so no
process of the job outlives its launcher on any node.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jabascli.errors import InputError

MAX_ORDER_BYTES = 65536
PASSED_ON = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables the launcher passes on to the agents, when set where it runs (e.g. an emulated
cluster sharing one machine's cores); ``JABAS_*`` variables (other than the token) go too."""


class LaunchOrder(BaseModel):
    """The first line a launcher writes on an agent's standard input."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)

    def line(self) -> bytes:
        return (self.model_dump_json() + "\n").encode()


def passed_on(environ: dict[str, str], token_env: str) -> dict[str, str]:
    """What of ``environ`` the launcher hands to its agents (never the token's own variable)."""
    return {
        name: value
        for name, value in environ.items()
        if (name in PASSED_ON or name.startswith("JABAS_")) and name != token_env
    }


def read_order(stream: BinaryIO) -> LaunchOrder:
    """The launcher's order from the first line of ``stream``; InputError naming what is wrong with it."""
    line = stream.readline(MAX_ORDER_BYTES + 1)
    if not line.endswith(b"\n"):
        raise InputError.at("standard input", None, "expected one line of JSON from the launcher (jabas run)")
    try:
        return LaunchOrder.model_validate(json.loads(line))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InputError.at("standard input", None, f"not a launch order: {where}: {first['msg']}") from None
    except ValueError as exc:
        raise InputError.at("standard input", None, f"not a launch order: {exc}") from None


def end_when_closed(fd: int) -> threading.Thread:
    """Watch the file descriptor ``fd`` in a daemon thread; at end-of-file send this process SIGTERM.

    It reads the descriptor itself, not a buffered stream over it, whose lock a daemon thread would still
    hold while the interpreter shuts down (which aborts it).
    """

    def watch() -> None:
        while os.read(fd, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so ``finally`` blocks (ending trainers) run."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
