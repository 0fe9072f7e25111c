"""``jabas profile all`` on a cluster: every server profiled on its own node, then the all-reduce between nodes.

When servers of the config are on other machines (:func:`jabascli.net.is_local`),
nothing has to be typed on any node:

1. Every node is connected to and checked first, at once, as ``jabas run``
   does (:func:`jabascli.elastic.remote.connect_nodes`: host keys, the same jabas
   version, the config and the working folder at the same paths); each one that
   fails is named in one line and nothing starts anywhere.
2. Each server is profiled on its own node, one server after another, by
   ``jabas profile all -c CONFIG --server NAME --launched`` with this run's GBS
   range, LBS plan and options (a server on this machine by the same command, a
   child process here). One after another: on an emulated cluster the nodes
   share one machine's cores, and servers profiled at once would measure each
   other. ``--launched`` makes the command print its progress as JSON lines
   (:func:`jabascli.profiler.events.event_line`), shown here with the server's name, and end as Ctrl-C
   would (measuring processes killed, no partial file) when its standard input
   closes: this process keeps it open, so Ctrl-C here, or a lost connection,
   ends it on its node.
3. With several servers, ``jabas profile comm --rank R --world W --master
   HOST:PORT --launched`` runs on every node at the same time, rank R on the
   R-th server of the config, rank 0's node the master at its ``host`` from the
   config, one process per device: every node's gloo (NCCL on GPUs) listens on
   its interface towards the master and the all-reduces cross the links between
   the nodes. The profile records every rank's address (``hosts``).
4. With ``--hybrid``, or a job with ``[parallel]``: the hybrid profiles taken on
   one machine (``jabas profile hybrid``) must be on disk before anything
   starts; last, the link between the first two servers' nodes is measured
   into them (:mod:`.remote_link`: ``jabas profile link`` on both nodes).

The nodes read the job from the same paths (a shared file system), so every
profile lands in the folders of the config's ``[profiles]``, which the solver
and ``jabas run`` read. Environment variables ``jabas run`` passes on to its
agents (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``JABAS_*``) go to every
profiling command too, so each server is measured with the threads its
trainers will have.
"""

from __future__ import annotations

import ipaddress
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.elastic.remote import Node, SshOptions, connect_nodes
from jabascli.errors import InputError, Problem
from jabascli.net import is_local
from jabascli.profiler.common import Reporter, ShareReporter
from jabascli.profiler.events import EVENT, parse_event
from jabascli.profiler.link import require_network
from jabascli.profiler.node_run import Lines, NodeRun, exit_reason, follow, jabas_argv, run_together, start
from jabascli.profiler.remote_link import LINK_S, link_stage
from jabascli.profiler.suite import (
    FIXED_S,
    INTER_PORT,
    StageResult,
    SuiteRun,
    comm_sizes,
    expected_seconds,
    gbs_bound,
    planned_lbs,
)

START_S = 5.0
"""Seconds a profiling command takes to start on a node (SSH session, the interpreter importing jabas)."""
PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class ClusterOptions:
    """What ``jabas profile all`` measures, handed to every node's command."""

    lbs: int | None = None
    gbs_max: int | None = None
    gbs_min: int | None = None
    iters: int = 20
    sizes: str | None = None
    force: bool = False
    hybrid: bool = False
    """``--hybrid`` was asked for: the hybrid profiles taken on one machine must be on disk, and the link between
    the first two servers' nodes is measured into them (:mod:`.remote_link`)."""


def profile_cluster(
    loaded: LoadedConfig,
    options: ClusterOptions,
    ssh: SshOptions | None = None,
    reporter: Reporter | None = None,
    port: int = INTER_PORT,
) -> SuiteRun:
    """Profile every server of ``loaded`` on its own node, then the all-reduce between the nodes.

    ``ssh``: how to reach the nodes (:class:`jabascli.elastic.remote.SshOptions`; default: ``~/.ssh``'s
    known_hosts and config). ``port``: where rank 0's node hosts the inter-node rendezvous (the next
    ports are tried when it is taken). InputError (exit 2) for bad input, before anything starts;
    RuntimeFailure (exit 1) naming each server that cannot be reached. A server whose profile fails
    does not stop the others: its stage is failed in the returned run.
    """
    from jabascli.profiler.comm import parse_sizes

    reporter = reporter or Reporter()
    servers = loaded.config.available()
    if not servers:
        raise InputError.at(loaded.path, "cluster.servers", "no servers: add a [[cluster.servers]] entry per node")
    hybrid = options.hybrid or loaded.config.parallel is not None
    if hybrid:
        require_network(loaded)  # taken on one machine, where every device type of the job is
    _check_reachable(loaded, servers)
    if options.sizes is not None:
        parse_sizes(options.sizes)
    bound = gbs_bound(loaded, options.gbs_max)
    lbs_values = None if options.lbs is not None else planned_lbs(loaded, servers, options.gbs_min, bound)
    start = options.lbs if options.lbs is not None else 32
    sweep = lbs_values or [start * k for k in range(1, 17) if bound is None or start * k <= max(start, bound)]
    index = {s.name: i for i, s in enumerate(loaded.config.cluster.servers)}
    remote = [index[s.name] for s in servers if not is_local(s.host)]
    nodes = {node.server.name: node for node in connect_nodes(loaded, remote, ssh or SshOptions())}
    try:
        weights = {
            s.name: START_S + expected_seconds(sweep, bound, 1, FIXED_S["intra"] * (s.devices > 1))["total"]
            for s in servers
        }
        inter_s = (START_S + FIXED_S["inter"]) * (len(servers) > 1)
        link_s = (START_S + LINK_S) * (hybrid and len(servers) > 1)
        expected = sum(weights.values()) + inter_s + link_s
        run = SuiteRun(gbs_max=bound, lbs_values=lbs_values, expected_s=expected)
        planned = f"LBS {', '.join(map(str, lbs_values))}" if lbs_values else f"LBS from {start} in steps of {start}"
        reporter.note(
            f"plan: {planned} on {', '.join(s.name for s in servers)}, each on its node, one after another"
            + (f" (GBS up to {bound})" if bound else "")
            + (", then the all-reduce between them" if len(servers) > 1 else "")
            + (f", then the link {servers[0].name}-{servers[1].name} for the hybrid planner" if link_s else "")
            + f"; expected to take about {_minutes(run.expected_s)}"
        )
        done = 0.0
        for server in servers:
            sub = ShareReporter(reporter, done, weights[server.name], run.expected_s, f"[{server.name}] ")
            argv = _profile_argv(loaded, server, options, bound, lbs_values)
            began = time.monotonic()
            stages, buckets = _profile_server(server, nodes.get(server.name), argv, sub)
            for stage in stages:
                stage.seconds = stage.seconds or time.monotonic() - began
            run.stages.extend(stages)
            run.bucket_mib = run.bucket_mib or buckets
            done += weights[server.name]
            reporter.progress(done, run.expected_s, f"[{server.name}] done")
        if len(servers) > 1:
            sizes = options.sizes or comm_sizes(run.bucket_mib)
            sub = ShareReporter(reporter, done, inter_s, run.expected_s, f"[{servers[0].name}] ")
            began = time.monotonic()
            stage = _inter(loaded, servers, nodes, sizes, options.force, port, sub)
            stage.seconds = time.monotonic() - began
            run.stages.append(stage)
            done += inter_s
            reporter.progress(done, run.expected_s, "inter: done")
        if link_s:
            sub = ShareReporter(reporter, done, link_s, run.expected_s, f"[{servers[0].name}] ")
            began = time.monotonic()
            stage = link_stage(loaded, servers, nodes, options.force, port + PORT_ATTEMPTS, sub)
            stage.seconds = time.monotonic() - began
            run.stages.append(stage)
            reporter.progress(run.expected_s, run.expected_s, "link: done")
        return run
    finally:
        for node in nodes.values():
            node.client.close()


def _check_reachable(loaded: LoadedConfig, servers: Sequence[ServerConfig]) -> None:
    """Every server's ``host`` must reach the others: a loopback address here cannot be the cluster's."""
    elsewhere = [s for s in servers if not is_local(s.host)]
    for server in servers:
        if is_local(server.host) and _is_loopback(server.host) and elsewhere:
            other = ", ".join(f"{s.name} ({s.host})" for s in elsewhere)
            raise InputError.at(
                loaded.path,
                f"cluster.servers.{server.name}.host",
                f"{server.host} cannot be reached from the other servers, {other}: give this machine's "
                "address on the cluster network, or profile each server on its node with "
                f"`jabas profile all -c {loaded.path} --server NAME`",
            )


def _is_loopback(host: str) -> bool:
    try:
        address = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        return ipaddress.ip_address(address).is_loopback
    except (OSError, ValueError):
        return False


def _profile_argv(
    loaded: LoadedConfig,
    server: ServerConfig,
    options: ClusterOptions,
    bound: int | None,
    lbs_values: list[int] | None,
) -> list[str]:
    argv = [
        *jabas_argv(server, is_local(server.host)),
        "profile",
        "all",
        "-c",
        str(loaded.path),
        "--server",
        server.name,
    ]
    argv += ["--iters", str(options.iters), "--launched"]
    if bound is not None:
        argv += ["--gbs-max", str(bound)]
    if options.gbs_min is not None:
        argv += ["--gbs-min", str(options.gbs_min)]
    if options.lbs is not None:
        argv += ["--lbs", str(options.lbs)]
    if options.sizes is not None:
        argv += ["--sizes", options.sizes]
    if options.force:
        argv.append("--force")
    if options.hybrid:  # a server whose memory holds no LBS is then fine: the hybrid planner splits the model
        argv.append("--hybrid")
    return argv


def _profile_server(
    server: ServerConfig, node: Node | None, argv: list[str], reporter: Reporter
) -> tuple[list[StageResult], list[float]]:
    """Run ``jabas profile all --server NAME`` for one server and follow it to its end; its stages, and the
    gradient buckets (MB) it measured or found."""
    result: dict[str, Any] = {}
    error: dict[str, Any] = {}
    raw: list[str] = []

    def handle(run: NodeRun, line: str) -> None:
        event = parse_event(line)
        if event is None:
            if line.strip():
                raw.append(line)
                reporter.note(line)
            return
        kind = event[EVENT]
        if kind == "pid":
            run.pid = int(event["pid"])
        elif kind == "progress":
            reporter.progress(float(event["completed"]), event.get("total"), str(event["what"]))
        elif kind == "note":
            reporter.note(str(event["message"]))
        elif kind == "result":
            result.update(event)
        elif kind == "error":
            error.update(event)

    lines: Lines = queue.Queue()
    code = follow([start(server, node, argv, lines)], lines, handle)[server.name]
    name = server.name
    if code == 0 and result:
        buckets = [float(b) for b in result.get("bucket_mib") or []]
        return [_stage(name, s) for s in result.get("stages", [])], buckets
    said = [str(x) for x in error.get("lines", [])] or raw[-3:] or [exit_reason(code)]
    if error.get("code") == 2:
        raise InputError([Problem(f"server {name!r}", None, line) for line in said])
    return [StageResult(f"profile {name}", False, "; ".join(said))], []


def _stage(server: str, record: dict[str, Any]) -> StageResult:
    """A node's stage under a name that says whose it is (``bucket`` measured for ``fast``: ``bucket fast``)."""
    name = str(record.get("name", "?"))
    if server not in name.split():
        name = f"{name} {server}"
    return StageResult(name, bool(record.get("ok")), str(record.get("detail", "")), float(record.get("seconds", 0)))


def _inter(
    loaded: LoadedConfig,
    servers: Sequence[ServerConfig],
    nodes: dict[str, Node],
    sizes: str,
    force: bool,
    port: int,
    reporter: ShareReporter,
) -> StageResult:
    """The all-reduce between the nodes: ``jabas profile comm --rank R`` on every node at once; ``reporter``
    shows rank 0's progress and notes, and any other line of a node under that node's name."""
    from jabascli.profiler.comm import profile_hosts
    from jabascli.profiles.formats import comm_profile_path, read_comm_profile

    folder = loaded.profile_dirs().communication
    if not force and comm_profile_path(folder, "inter").is_file():
        existing = read_comm_profile(folder, "inter")
        assert existing is not None
        hosts = profile_hosts(existing)
        between = f" between {', '.join(hosts)}" if hosts else ""
        return StageResult("inter", True, f"{len(existing.measured_ms)} sizes{between} (on disk)")
    world = len(servers)
    for attempt in range(PORT_ATTEMPTS):
        master = f"{servers[0].host}:{port + attempt}"
        reporter.note(f"{world} nodes meeting at {master}")
        outcome = _inter_once(loaded, servers, nodes, sizes, master, reporter)
        if isinstance(outcome, StageResult):
            return outcome
        if attempt == PORT_ATTEMPTS - 1:
            return StageResult("inter", False, outcome)
        reporter.note(f"port {port + attempt} is in use on {servers[0].name}: trying {port + attempt + 1}")
    raise AssertionError("unreachable")


def _inter_once(
    loaded: LoadedConfig,
    servers: Sequence[ServerConfig],
    nodes: dict[str, Node],
    sizes: str,
    master: str,
    reporter: ShareReporter,
) -> StageResult | str:
    """One try of the inter-node profile; a string when rank 0's port was taken (the caller tries another)."""
    argvs = []
    for rank, server in enumerate(servers):
        argv = [*jabas_argv(server, is_local(server.host)), "profile", "comm", "-c", str(loaded.path)]
        argv += ["--server", server.name, "--nprocs", str(server.devices), "--rank", str(rank)]
        argv += ["--world", str(len(servers)), "--master", master, "--sizes", sizes, "--force", "--launched"]
        argvs.append((server, argv))
    done = run_together(argvs, nodes, reporter)
    first = servers[0].name
    if all(code == 0 for code in done.codes.values()) and first in done.results:
        record = done.results[first]
        hosts = record.get("hosts") or []
        between = f" between {', '.join(hosts)}" if hosts else ""
        return StageResult("inter", True, f"{record.get('world_size')} processes{between}, {record.get('sizes')} sizes")
    if any("in use" in line for line in done.errors.get(first, [])):
        return "; ".join(done.errors[first])
    return StageResult("inter", False, done.failure(first))


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
