"""A real Slurm (Debian's 22.05) over the emulated nodes of ``tests/cluster.py``: one controller, one slurmd per node.

:class:`SlurmCluster` starts, all in the foreground so each Popen's pid is the daemon's own:

* one ``munged`` as the ``munge`` user, with a key, socket, pid, seed and log of its own in a folder of
  its own (``/tmp/jbslurm-*/munge``, owned by ``munge``: pytest's ``tmp_path`` lies under folders only
  root may enter, which munged refuses to use);
* one ``slurmctld`` on the host, reachable from the nodes at the bridge's address
  (``SlurmctldHost=<this host's name>(<cluster.host_address>)``) on a free port;
* one ``slurmd -N NAME`` per node inside its namespace (``nsenter --net=...``), listening on its node's
  address (``NodeName=NAME NodeAddr=<address> CPUs=C Feature=<device type>``).

Everything Slurm writes (state, spool, pid files, logs) lies under ``root``; the config is
``root/slurm.conf``, named to every Slurm command through ``SLURM_CONF`` (:meth:`SlurmCluster.env`).
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no cgroups, so steps run on the
host's file system and process tree, only their network namespace being their node's. Jobs therefore
see the same files as the test (the "shared file system" of a real cluster).

:meth:`SlurmCluster.stop` cancels what is still queued, then stops every daemon by its pid (SIGTERM,
SIGKILL after a grace period), slurmds first; it runs also when start() fails. The fixture
``slurm_factory`` stops every Slurm it made after the test, before the emulated cluster goes down.
Where the tests are not root or the packages are missing, :func:`require_slurm` skips with the reason
(``make test`` installs ``slurmctld slurmd slurm-client munge`` when run as root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster import EmulatedCluster, Node

TOOLS = ("slurmctld", "slurmd", "sinfo", "srun", "sbatch", "squeue", "scancel", "scontrol", "munged")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
KILL_WAIT_S = 5.0


class SlurmError(RuntimeError):
    """Slurm could not be started or stopped; the message says why (with the tail of the daemon's log)."""


def slurm_unavailable_reason() -> str | None:
    """Why a test Slurm cannot run here, in one line, or None."""
    if os.geteuid() != 0:
        return "a test Slurm needs root (slurmd in network namespaces, munged as the munge user)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"Slurm not installed ({', '.join(missing)} missing; `make test` as root installs it)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (install the munge package)"
    return None


def require_slurm() -> None:
    """Skip the calling test, with the reason, where a test Slurm cannot run."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def free_port(address: str = "0.0.0.0") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SlurmNodeSpec:
    """An emulated node as a Slurm node: its feature (the device type) and CPUs."""

    node: str
    feature: str
    cpus: int = 1


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[Any]
    log: Path


class SlurmCluster:
    """Slurm over an :class:`EmulatedCluster` (see the module's docstring); a context manager for start() and stop()."""

    def __init__(self, cluster: EmulatedCluster, nodes: Sequence[SlurmNodeSpec], root: Path | None = None) -> None:
        self.cluster = cluster
        self.specs = list(nodes)
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="jbslurm-")) if root is None else root
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.socket = self.munge_dir / "munge.socket.2"
        self.daemons: list[Daemon] = []
        self.ctld_port = 0
        self.slurmd_port = 6818  # each slurmd in a namespace of its own: one port for all

    # -- set-up ---------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a Slurm command talking to this Slurm."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def node(self, name: str) -> Node:
        return self.cluster.node(name)

    def start(self) -> SlurmCluster:
        try:
            for sub in ("state", "spool", "log"):
                (self.root / sub).mkdir(exist_ok=True)
            self._start_munged()
            self.ctld_port = free_port()
            self.conf.write_text(self.config_text())
            self._start_slurmctld()
            for spec in self.specs:
                self._start_slurmd(spec)
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def config_text(self) -> str:
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=jabastest",
            f"SlurmctldHost={host}({self.cluster.host_address})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=30",  # Slurm's default: SIGTERM, then SIGKILL 30 s later
            "InactiveLimit=0",
            "MinJobAge=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "SchedulerParameters=sched_interval=1,bf_interval=1",  # a het job is scheduled by the backfill pass only
        ]
        for spec in self.specs:
            node = self.cluster.node(spec.node)
            lines.append(
                f"NodeName={spec.node} NodeAddr={node.address} CPUs={spec.cpus} Feature={spec.feature} State=UNKNOWN"
            )
        names = ",".join(s.node for s in self.specs)
        lines.append(f"PartitionName=jabas Nodes={names} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _start_munged(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        log = self.munge_dir / "munged.log"
        argv = [
            "munged",
            "--foreground",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={self.munge_dir / 'munged.pid'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}",
            f"--log-file={log}",
        ]

        def as_munge() -> None:
            os.setgid(munge.pw_gid)
            os.setgroups([])
            os.setuid(munge.pw_uid)

        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=as_munge
        )
        self.daemons.append(Daemon("munged", proc, log))
        self._wait_for(lambda: self.socket.exists(), "munged", f"its socket {self.socket}")

    def _start_slurmctld(self) -> None:
        log = self.root / "log" / "slurmctld.log"
        proc = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.root / "log" / "slurmctld.out").open("wb"),
        )
        self.daemons.append(Daemon("slurmctld", proc, log))
        self._wait_for(lambda: self._ping(), "slurmctld", "an answer to `scontrol ping`")

    def _ping(self) -> bool:
        result = self.run(["scontrol", "ping"], check=False)
        return result.returncode == 0 and "UP" in result.stdout

    def _start_slurmd(self, spec: SlurmNodeSpec) -> None:
        log = self.root / "log" / f"slurmd-{spec.node}.log"
        (self.root / "spool" / spec.node).mkdir(exist_ok=True)
        proc = self.cluster.popen(
            spec.node,
            ["slurmd", "-D", "-N", spec.node, "-f", str(self.conf)],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.root / "log" / f"slurmd-{spec.node}.out").open("wb"),
        )
        self.daemons.append(Daemon(f"slurmd {spec.node}", proc, log))

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until every node is idle in ``sinfo``."""
        names = {s.node for s in self.specs}
        self._wait_for(lambda: self.states() == dict.fromkeys(names, "idle"), "the slurmds", "every node idle", timeout)

    def states(self) -> dict[str, str]:
        """Node name -> its state in ``sinfo`` (idle, alloc, mix, down*, ...)."""
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        found = {}
        for line in result.stdout.splitlines():
            name, _, state = line.partition(" ")
            found[name] = state.strip()
        return found

    def _wait_for(self, ready: Callable[[], bool], who: str, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d for d in self.daemons if d.proc.poll() is not None]
            if dead:
                raise SlurmError(f"{dead[0].name} exited ({dead[0].proc.returncode}): {self.log_tail(dead[0])}")
            if time.monotonic() > deadline:
                raise SlurmError(f"{who}: no {what} within {timeout:g} s; {self.all_logs()}")
            time.sleep(0.1)

    # -- use ------------------------------------------------------------------------------------------------

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command run on the host (the login node), output captured as text."""
        if isinstance(argv, str):
            raise TypeError("argv must be a list (no shell)")
        result = subprocess.run(
            list(argv), env=kwargs.pop("env", self.env()), capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        return result

    def queue(self) -> list[str]:
        """``squeue``'s lines (job id, state), one per job still known as pending or running."""
        return [line for line in self.run(["squeue", "-h", "-o", "%i %T"]).stdout.splitlines() if line.strip()]

    def wait_queue_empty(self, timeout: float = 60) -> list[str]:
        """Wait until ``squeue`` lists nothing; returns what it still lists after ``timeout`` (nothing: [])."""
        deadline = time.monotonic() + timeout
        while (left := self.queue()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def job_state(self, job_id: str) -> str:
        """A job's state in ``scontrol show job`` (PENDING, RUNNING, COMPLETED, CANCELLED ...), '' once forgotten."""
        result = self.run(["scontrol", "show", "job", job_id], check=False)
        match = re.search(r"JobState=(\S+)", result.stdout)
        return match.group(1) if match else ""

    def log_tail(self, daemon: Daemon, chars: int = 1500) -> str:
        text = ""
        for path in (daemon.log, daemon.log.with_suffix(".out")):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")[-chars:]
        return text.replace("\n", " | ")

    def all_logs(self) -> str:
        return "; ".join(f"{d.name}: {self.log_tail(d, 600)}" for d in self.daemons)

    # -- tear-down ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, then stop every daemon by its pid (SIGTERM, SIGKILL after a grace period): slurmds,
        slurmctld, munged. Raises SlurmError if one could not be stopped."""
        if any(d.name == "slurmctld" and d.proc.poll() is None for d in self.daemons):
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user", "root"], check=False, timeout=10)
                self.wait_queue_empty(timeout=STOP_GRACE_S)
        order = sorted(self.daemons, key=lambda d: (d.name.startswith("munged"), d.name.startswith("slurmctld")))
        survivors = []
        for daemon in order:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
                try:
                    daemon.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    daemon.proc.kill()
                    try:
                        daemon.proc.wait(KILL_WAIT_S)
                    except subprocess.TimeoutExpired:
                        survivors.append(f"{daemon.name} (pid {daemon.proc.pid})")
        self.daemons.clear()
        if self._own_root and not os.environ.get("JABAS_KEEP_SLURM"):
            shutil.rmtree(self.root, ignore_errors=True)
        if survivors:
            raise SlurmError(f"Slurm daemons still running: {', '.join(survivors)}")


def _slurm_factory(cluster_factory: Callable[..., EmulatedCluster]) -> Iterator[Callable[..., SlurmCluster]]:
    """Fixture ``slurm_factory``: ``slurm_factory(cluster, [SlurmNodeSpec("n0", "fast", 2), ...])`` starts Slurm over
    an emulated cluster (from ``cluster_factory``) and returns it once every node is idle; every Slurm made is
    stopped after the test (before the cluster goes down). Skips where Slurm cannot run (require_slurm)."""
    require_slurm()
    made: list[SlurmCluster] = []

    def make(cluster: EmulatedCluster, nodes: Sequence[SlurmNodeSpec]) -> SlurmCluster:
        slurm = SlurmCluster(cluster, nodes)
        made.append(slurm)
        return slurm.start()

    try:
        yield make
    finally:
        errors = []
        for slurm in reversed(made):
            try:
                slurm.stop()
            except SlurmError as error:
                errors.append(str(error))
        if errors:
            raise SlurmError("; ".join(errors))


def __getattr__(name: str) -> Any:
    """``from tests.slurm import slurm_factory`` gives the pytest fixture (pytest imported only then)."""
    if name == "slurm_factory":
        import pytest

        fixture = pytest.fixture(_slurm_factory, name="slurm_factory")
        globals()[name] = fixture
        return fixture
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
