"""Inside a Slurm allocation: which server this node is, where the scheduler is, and SIGTERM from ``scancel``.

A job submitted with ``jabas slurm submit`` (its batch script: :mod:`jabascli.elastic.slurm_script`) runs
``jabas slurm schedule`` on the allocation's first node (the first node of its first heterogeneous component,
where the batch script runs) and one ``jabas worker --slurm`` per node through ``srun``.
Nothing is typed per node: each reads Slurm's environment.

* The allocation's nodes are ``SLURM_JOB_NODELIST_HET_GROUP_<i>`` for ``i < SLURM_HET_SIZE`` in a
  heterogeneous job (the batch script's ``SLURM_JOB_NODELIST`` names only its own component's nodes),
  else ``SLURM_JOB_NODELIST``; this node is ``SLURMD_NODENAME``.
* A Slurm node is the ``[[cluster.servers]]`` entry whose ``name`` is its NodeName, else whose ``host``
  is its NodeName or its NodeAddr (``scontrol show node``, asked only when a name does not match).
* The scheduler listens on the ``host`` of the first node's server, at ``[scheduler] port``; the
  allocation's servers are the job's servers (``[cluster] available_servers``).
* The token is ``JABAS_TOKEN``, else the job folder's token file (``<run folder>/slurm/<job id>/token``,
  written by the batch script with ``jabas token``, mode 0600), else ``[scheduler] token_file``.

``scancel`` sends SIGTERM to every process of the job at once (Slurm's KillWait, 30 s by default, before
SIGKILL), trainers included, which would end them where they are, without a checkpoint.
:func:`hold_sigterm` keeps SIGTERM blocked in the scheduler's and agents' main threads, so the trainers
they start inherit it blocked (a signal mask survives fork and exec) and only a watcher thread takes
it: in the scheduler it stops the job at the next iteration (the trainers all stop after the same
iteration, write the checkpoint and exit 0, as ``jabas job stop`` does); an agent notes it and carries
on until the scheduler says the job is over. A trainer with SIGTERM blocked ends on SIGKILL, which an
agent sends :data:`jabascli.children.GRACE_S` after its SIGTERM when it kills a generation.
"""

from __future__ import annotations

import _thread
import ipaddress
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jabascli.config import LoadedConfig
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError, RuntimeFailure
from jabascli.net import interface_of

if TYPE_CHECKING:
    from jabascli.elastic.agent import WorkerAgent
    from jabascli.elastic.job import Scheduler
    from jabascli.elastic.protocol import JobStatus

JOB_ID = "SLURM_JOB_ID"
NODE_NAME = "SLURMD_NODENAME"
HET_SIZE = "SLURM_HET_SIZE"
NODELIST = "SLURM_JOB_NODELIST"
TOKEN_NAME = "token"
SCONTROL_TIMEOUT_S = 30.0
RELEASE_POLL_S = 1.0
"""How often, with ``[slurm] release_idle``, the scheduler looks for servers the job no longer uses."""

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def in_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm job (``SLURM_JOB_ID`` is set)."""
    return bool((os.environ if environ is None else environ).get(JOB_ID))


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``n[0-2],gpu[08-10,12]`` -> n0 n1 n2 gpu08 gpu09 gpu10 gpu12.

    Leading zeros are kept (``[08-10]`` gives 08, 09, 10); several bracket groups in one name multiply.
    """
    names: list[str] = []
    for item in _split_top(text.strip()):
        names += _expand_one(item, text)
    return names


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise InputError.at(NODELIST, None, f"host list {whole!r}: '[' without ']'")
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_one(rest, whole) if rest else [""]
    names = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise InputError.at(NODELIST, None, f"host list {whole!r}: {part!r} is not N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        width = len(first)
        for number in range(int(first), int(last) + 1):
            names += [f"{prefix}{number:0{width}d}{tail}" for tail in tails]
    return names


@dataclass(frozen=True)
class Allocation:
    """What Slurm's environment says about the job this process runs in."""

    job_id: str
    nodes: list[str]
    """Every node of the allocation: the first heterogeneous component's first, in Slurm's order."""
    node: str | None
    """This node's NodeName (``SLURMD_NODENAME``; None outside a task or batch script)."""
    components: list[list[str]] = field(default_factory=list)
    """The nodes of each heterogeneous component (one list for a job that is not heterogeneous)."""

    @property
    def heterogeneous(self) -> bool:
        return len(self.components) > 1

    @property
    def first(self) -> str:
        return self.nodes[0]


def allocation(environ: Mapping[str, str] | None = None) -> Allocation:
    """The allocation this process runs in, from Slurm's environment; InputError outside one."""
    env = os.environ if environ is None else environ
    job_id = env.get(JOB_ID)
    if not job_id:
        raise InputError.at(None, "--slurm", f"not inside a Slurm job ({JOB_ID} is not set): run it under sbatch/srun")
    het = env.get(HET_SIZE)
    if het and het.isdigit():
        lists = [env.get(f"{NODELIST}_HET_GROUP_{i}", "") for i in range(int(het))]
    else:
        lists = [env.get(NODELIST, "")]
    nodes: list[str] = []
    components = [expand_hostlist(text) for text in lists]
    for part in components:
        nodes += [name for name in part if name not in nodes]
    if not nodes:
        raise InputError.at(None, NODELIST, "Slurm's environment names no node of the job")
    return Allocation(job_id, nodes, env.get(NODE_NAME) or None, components)


def node_addresses(names: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """NodeName -> NodeAddr of Slurm ``names`` (``scontrol show node -o``; an argument list, no shell)."""
    if not names:
        return {}
    try:
        result = subprocess.run(
            ["scontrol", "show", "node", "-o", ",".join(names)],
            env=dict(os.environ if environ is None else environ),
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailure.at(None, None, f"scontrol show node: {exc}") from None
    found = {}
    for line in result.stdout.splitlines():
        name, addr = re.search(r"NodeName=(\S+)", line), re.search(r"NodeAddr=(\S+)", line)
        if name and addr:
            found[name.group(1)] = addr.group(1)
    return found


def match_servers(
    loaded: LoadedConfig,
    nodes: list[str],
    addresses: Callable[[list[str]], dict[str, str]] = node_addresses,
) -> dict[str, int]:
    """Slurm node -> index of its ``[[cluster.servers]]`` entry: by server name, else by ``host`` equal to the
    NodeName or NodeAddr. InputError naming every node that matches no server, or two nodes one server."""
    servers = loaded.config.cluster.servers
    by_name = {s.name: i for i, s in enumerate(servers)}
    by_host: dict[str, int] = {}
    for i, s in enumerate(servers):
        by_host.setdefault(s.host, i)
    found = {node: by_name.get(node, by_host.get(node)) for node in nodes}
    unknown = [node for node, index in found.items() if index is None]
    if unknown:
        for node, addr in addresses(unknown).items():
            if node in found and addr in by_host:
                found[node] = by_host[addr]
    problems = [
        f"Slurm node {node} is no server of the config (no [[cluster.servers]] entry named so, or with it or its "
        "NodeAddr as host)"
        for node, index in found.items()
        if index is None
    ]
    seen: dict[int, str] = {}
    for node, index in found.items():
        if index is not None and index in seen:
            problems.append(f"Slurm nodes {seen[index]} and {node} are both server {servers[index].name}")
        elif index is not None:
            seen[index] = node
    if problems:
        raise InputError.at(loaded.path, "cluster.servers", "; ".join(problems))
    return {node: index for node, index in found.items() if index is not None}


def this_server(loaded: LoadedConfig, where: Allocation) -> int:
    """The index of this node's server: the one named after its NodeName, or whose host is its NodeName or an
    address one of its interfaces holds."""
    servers = loaded.config.cluster.servers
    if where.node is not None:
        for i, s in enumerate(servers):
            if where.node in (s.name, s.host):
                return i
    for i, s in enumerate(servers):
        if _is_own_address(s.host):
            return i
    raise InputError.at(
        loaded.path,
        "cluster.servers",
        f"this node ({where.node or 'unknown to Slurm'}) is no server of the config: no [[cluster.servers]] entry "
        "is named after it or has its name or one of its addresses as host",
    )


def _is_own_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 address, not loopback, held by one of this node's interfaces."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.version == 4 and not ip.is_loopback and interface_of(host) is not None


def scheduler_address(loaded: LoadedConfig, where: Allocation, servers: dict[str, int] | None = None) -> str:
    """ADDR:PORT of the job's scheduler: the host of the first node's server, at ``[scheduler] port``."""
    matched = servers if servers is not None else match_servers(loaded, [where.first])
    host = loaded.config.cluster.servers[matched[where.first]].host
    return f"{host}:{loaded.config.scheduler.port}"


def job_folder(loaded: LoadedConfig, job_id: str) -> Path:
    """The shared folder of one Slurm job of this jabas job: its token (and nothing secret elsewhere)."""
    return run_folder(loaded) / "slurm" / job_id


def token_file(loaded: LoadedConfig, job_id: str) -> Path:
    return job_folder(loaded, job_id) / TOKEN_NAME


@dataclass(frozen=True)
class WorkerPlace:
    """What a ``jabas worker --slurm`` needs: its rank (its server's index), the scheduler and the token."""

    rank: int
    scheduler: str
    token: str


def worker_place(
    loaded: LoadedConfig, scheduler: str | None = None, environ: Mapping[str, str] | None = None
) -> WorkerPlace:
    """This node's server, the scheduler's address (``scheduler`` if given) and the token, from Slurm's
    environment (see the module's docstring)."""
    env = os.environ if environ is None else environ
    where = allocation(env)
    rank = this_server(loaded, where)
    address = scheduler or scheduler_address(loaded, where)
    return WorkerPlace(rank, address, job_token(loaded, where.job_id, env))


def job_token(loaded: LoadedConfig, job_id: str, environ: Mapping[str, str]) -> str:
    """``JABAS_TOKEN``, else the Slurm job's token file when it exists, else ``[scheduler] token_file``."""
    from jabascli.elastic.token import TOKEN_ENV, load_token, read_token_file

    path = token_file(loaded, job_id)
    return read_token_file(path) if not environ.get(TOKEN_ENV) and path.exists() else load_token(loaded, environ)


def leave_if_idle(agents: list[WorkerAgent]) -> bool:
    """On SIGTERM in ``jabas worker --slurm``: an agent running no trainer (its node given back, or nothing
    started yet; ``agents`` holds it once made) ends at once (KeyboardInterrupt in its main thread); one with
    trainers carries on until the scheduler, which stops the job, says it is over. True if it ends."""
    if any(t.proc.poll() is None for agent in agents for run in list(agent.runs) for t in run.trainers):
        return False
    _thread.interrupt_main()
    return True


def hold_sigterm(on_sigterm: Callable[[], None]) -> threading.Thread:
    """Block SIGTERM in this thread (call it from the main thread, before any child or thread is started: both
    inherit the mask) and call ``on_sigterm()`` from a watcher thread each time it arrives."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an ignored signal would be discarded, not held
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        while True:
            signal.sigwait({signal.SIGTERM})
            on_sigterm()

    thread = threading.Thread(target=watch, name="sigterm", daemon=True)
    thread.start()
    return thread


# -- the scheduler of an allocation ------------------------------------------------------------------------


def serve_allocation(
    loaded: LoadedConfig,
    environ: Mapping[str, str] | None = None,
    on_start: Callable[[str, list[str], bool], None] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> JobStatus:
    """``jabas slurm schedule``: the job's scheduler on this node (the allocation's first), until the job is over.

    The job's servers are those of the allocation's nodes; it resumes from the job's newest checkpoint when
    there is one (a resubmitted job continues). While it runs, the run folder's ``scheduler.json`` names its
    address and token file, so ``jabas job status -c CONFIG`` finds it from any machine that shares the
    folder. SIGTERM (``scancel``) stops the job at the next iteration: the trainers checkpoint.
    ``on_start(address, servers, resuming)`` is called before it serves; ``on_line(text)`` with each node
    given back to Slurm (``[slurm] release_idle``, :class:`Releaser`).
    """
    made: list[Scheduler] = []
    asked = threading.Event()

    def stop() -> None:
        asked.set()
        for scheduler in made:
            with scheduler.lock:
                scheduler.stop("now")

    # First: a thread started before this (numpy's BLAS pool, at import) would take SIGTERM itself, and die of it.
    hold_sigterm(stop)
    from jabascli.elastic.agent import check_writable
    from jabascli.elastic.job import Scheduler
    from jabascli.elastic.local import Steering
    from jabascli.elastic.service import serve
    from jabascli.engine.checkpoint_store import newest_checkpoint
    from jabascli.engine.layout import checkpoint_folder

    env = os.environ if environ is None else environ
    where = allocation(env)
    matched = match_servers(loaded, where.nodes)
    cluster = loaded.config.cluster
    taken = set(matched.values())
    cluster.available_servers = [s.name for i, s in enumerate(cluster.servers) if i in taken]
    host = cluster.servers[matched[where.first]].host
    port = loaded.config.scheduler.port
    path = token_file(loaded, where.job_id)
    token = job_token(loaded, where.job_id, env)
    check_writable(checkpoint_folder(loaded))
    resume = newest_checkpoint(checkpoint_folder(loaded)) is not None
    planner = None
    if loaded.config.scaling.enabled:
        from jabascli.elastic.autoscaling import AutoScaler

        planner = AutoScaler(loaded)
    scheduler = Scheduler(loaded, resume=resume, planner=planner)
    made.append(scheduler)
    if asked.is_set():
        stop()
    if on_start is not None:
        on_start(f"{host}:{port}", list(cluster.available_servers), resume)
    steering = Steering(f"{host}:{port}", path if path.exists() else loaded.config.scheduler.token_file or path)
    steering_file = steering.write(run_folder(loaded))
    done = threading.Event()
    if loaded.config.slurm.release_idle:
        releaser = Releaser(loaded, where, matched, env)

        def release() -> None:
            while not done.wait(RELEASE_POLL_S):
                with scheduler.lock:
                    status = scheduler.status()
                for line in releaser.check(status):
                    if on_line is not None:
                        on_line(line)

        threading.Thread(target=release, name="release-idle", daemon=True).start()
    try:
        return serve(scheduler, token, host, port)
    finally:
        done.set()
        steering_file.unlink(missing_ok=True)


class Releaser:
    """``[slurm] release_idle``: give back to Slurm the nodes of servers the job has moved off.

    Once the job runs on an allocation that leaves out servers of the Slurm job (a move, the auto-scaling
    planner's or ``jabas job move``'s), their nodes are released: in a heterogeneous job, each component
    whose nodes all went idle is cancelled (``scancel JOB+OFFSET``; Slurm 22.05 resizes no component of a
    heterogeneous job, so a component some of whose nodes still train is kept whole); in a job that is not,
    the job shrinks to the nodes in use (``scontrol update JobId=JOB NodeList=...``), its first node (where
    the scheduler runs) always kept. A node given back is not taken again: the job does not move back to it.
    """

    def __init__(self, loaded: LoadedConfig, where: Allocation, matched: dict[str, int], environ: Mapping[str, str]):
        self.where, self.environ = where, environ
        self.server_of = {node: loaded.config.cluster.servers[index].name for node, index in matched.items()}
        self.held: dict[int, list[str]] = dict(enumerate(where.components or [where.nodes]))

    def check(self, status: JobStatus) -> list[str]:
        """Release what ``status`` (the scheduler's) no longer uses; a line for each release, or each failure."""
        if status.state != "running" or not status.allocation:
            return []
        used = set(status.allocation)
        idle = {node for nodes in self.held.values() for node in nodes if self.server_of.get(node) not in used}
        idle.discard(self.where.first)
        if not idle:
            return []
        if self.where.heterogeneous:
            lines = []
            for offset, nodes in sorted(self.held.items()):
                if nodes and all(node in idle for node in nodes):
                    lines.append(self._run(["scancel", f"{self.where.job_id}+{offset}"], offset, nodes))
            return lines
        kept = [node for node in self.held[0] if node not in idle]
        gone = [node for node in self.held[0] if node in idle]
        return [self._run(["scontrol", "update", f"JobId={self.where.job_id}", f"NodeList={','.join(kept)}"], 0, gone)]

    def _run(self, argv: list[str], offset: int, nodes: list[str]) -> str:
        servers = ", ".join(self.server_of.get(node, node) for node in nodes)
        try:
            result = subprocess.run(
                argv, env=dict(self.environ), capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"could not give back {', '.join(nodes)} (servers {servers}): {exc}"
        if result.returncode != 0:
            message = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
            return f"could not give back {', '.join(nodes)} (servers {servers}): {' '.join(argv)}: {message}"
        self.held[offset] = [node for node in self.held[offset] if node not in nodes]
        return f"gave back {', '.join(nodes)} (servers {servers}) to Slurm: {' '.join(argv)}"
