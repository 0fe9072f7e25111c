"""Faults on purpose: a given rank fails at a given step, for tests of what a job does when a trainer is lost.

``JABAS_FAULT`` lists faults as ``RANK:STEP:KIND``, comma-separated; ``KIND`` is

- ``exit``: the process ends at once with code 3, without cleanups (as a crash does);
- ``kill``: it sends itself SIGKILL (as the out-of-memory killer or a lost node does);
- ``hang``: it stops making progress and never returns (a deadlock, a frozen device), while
  its process stays alive;
- ``kill_mid_update``: it sends itself SIGKILL right after its first bucket update of the
  step, with ``overlap`` weight sync (a job whose gradients fill two buckets or more), so the
  other ranks have applied part of the step's update when their next bucket's all-reduce
  fails (:mod:`jabascli.engine.bucket_undo`). Without ``overlap`` it never fires.

Rank ``RANK`` fires the fault as it begins step ``STEP`` (1 is the first iteration of the
job), so the other ranks are inside that iteration's collectives when it fails. Each fault
fires once per job, not again after the job is restarted from a checkpoint taken before
it: the rank that fires it first leaves a marker in the run folder (``faults/``), which holds
the wall time it fired at.

Example: ``JABAS_FAULT=1:5:kill jabas run -c job.toml --max-restarts 1`` loses rank 1
in step 5; ``[scheduler] collective_timeout_s`` bounds how long the others wait for it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from jabascli.errors import InputError

FAULT_ENV = "JABAS_FAULT"
FaultKind = Literal["exit", "kill", "hang", "kill_mid_update"]
KINDS: tuple[FaultKind, ...] = ("exit", "kill", "hang", "kill_mid_update")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: FaultKind

    @property
    def marker(self) -> str:
        return f"rank{self.rank}-step{self.step}-{self.kind}"


def parse_faults(spec: str) -> list[Fault]:
    """The faults of a ``JABAS_FAULT`` value; InputError naming the variable and the bad entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        fields = entry.split(":")
        try:
            rank, step, kind = int(fields[0]), int(fields[1]), fields[2]
            if len(fields) != 3 or rank < 0 or step < 1 or kind not in KINDS:
                raise ValueError
        except (ValueError, IndexError):
            raise InputError.at(
                "environment", FAULT_ENV, f"{entry!r}: expected RANK:STEP:KIND, KIND one of {', '.join(KINDS)}"
            ) from None
        faults.append(Fault(rank, step, cast(FaultKind, kind)))
    return faults


class FaultInjector:
    """This rank's faults (none, unless ``JABAS_FAULT`` names it); :meth:`before_step` fires them."""

    def __init__(self, faults: list[Fault], rank: int, folder: Path) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.folder = folder
        self._armed: Fault | None = None
        """A ``kill_mid_update`` of the step under way, fired by :meth:`after_bucket_update`."""

    @property
    def in_updates(self) -> bool:
        """A fault fires inside a step's bucket updates: :meth:`after_bucket_update` must be called."""
        return any(f.kind == "kill_mid_update" for f in self.faults)

    @classmethod
    def from_environ(cls, rank: int, run_folder: Path, environ: Mapping[str, str] | None = None) -> FaultInjector:
        spec = (os.environ if environ is None else environ).get(FAULT_ENV, "")
        return cls(parse_faults(spec) if spec else [], rank, run_folder / "faults")

    def before_step(self, step: int) -> None:
        """Fire a fault of ``step`` (the step about to run) that has not fired in this job yet."""
        self._armed = None
        for fault in self.faults:
            if fault.step == step and fault.kind == "kill_mid_update":
                self._armed = fault
            elif fault.step == step and self._first_time(fault):
                _fire(fault.kind)

    def after_bucket_update(self) -> None:
        """A bucket of the step under way was just updated (``overlap``; called from a communication thread)."""
        fault, self._armed = self._armed, None
        if fault is not None and self._first_time(fault):
            _fire("kill")

    def _first_time(self, fault: Fault) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.folder / fault.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, f"{time.time()!r}\n".encode())  # when it fired (wall clock): benchmarks/recovery.py
        finally:
            os.close(fd)
        return True


def _fire(kind: FaultKind) -> None:  # pragma: no cover - the process ends or stops here
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: alive, and no progress; SIGTERM still ends it (it raises SystemExit in a trainer)
        time.sleep(3600)
