"""``jabas profile all`` on a cluster, its last stage for the hybrid planner: the link between two nodes.

With ``--hybrid``, or a job with ``[parallel]``, the hybrid profiles ``jabas profile hybrid`` took on one machine
must be on disk (:func:`jabascli.profiler.link.require_network`); their ``inter`` link is loopback's. Once every
server is profiled, ``jabas profile link -c CONFIG --rank R --master HOST:PORT --launched`` runs on the nodes of the
config's first two servers at once, as the inter-node all-reduce does (:func:`.node_run.run_together`): rank 0 on the
first server's node, its store at that server's ``host``, rank 1 on the second's. Rank 0 writes what crossed the link
as the profiles' ``inter`` link (:mod:`.link`). A link already measured so is kept unless ``force``; a port taken
on rank 0's node is tried again at the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.elastic.remote import Node
from jabascli.net import is_local
from jabascli.profiler.common import ShareReporter
from jabascli.profiler.link import LinkRun, link_on_disk, require_network
from jabascli.profiler.node_run import jabas_argv, run_together
from jabascli.profiler.suite import StageResult

LINK_S = 10.0
"""Rough seconds of the link stage: two fresh measuring processes, then 7 sizes of 4 collectives on a fast link."""
PORT_ATTEMPTS = 3


def link_stage(
    loaded: LoadedConfig,
    servers: Sequence[ServerConfig],
    nodes: dict[str, Node],
    force: bool,
    port: int,
    reporter: ShareReporter,
) -> StageResult:
    """The link between the nodes of ``servers[0]`` and ``servers[1]``, written into the job's hybrid profiles;
    ``port``: where rank 0's node listens (then the next ones while it is taken)."""
    pair = servers[:2]
    name = f"link {pair[0].name}-{pair[1].name}"
    path = require_network(loaded)
    if not force:
        existing = link_on_disk(path)
        if existing is not None:
            return StageResult(name, True, f"{_detail(existing)} (on disk)")
    for attempt in range(PORT_ATTEMPTS):
        master = f"{pair[0].host}:{port + attempt}"
        reporter.note(f"link: {pair[0].name} and {pair[1].name} meeting at {master}")
        argvs = [
            (s, [*jabas_argv(s, is_local(s.host)), "profile", "link", "-c", str(loaded.path)])
            for s in pair  # ranks 0 and 1
        ]
        for rank, (_, argv) in enumerate(argvs):
            argv += ["--rank", str(rank), "--master", master, "--launched"]
        done = run_together(argvs, nodes, reporter)
        first = pair[0].name
        record = done.results.get(first)
        if all(code == 0 for code in done.codes.values()) and record is not None:
            hosts = [str(h) for h in record.get("hosts") or []]
            said = f"{record.get('sizes')} sizes, {float(record.get('gbps', 0)):.2g} GB/s between {' and '.join(hosts)}"
            return StageResult(name, True, said)
        taken = any("in use" in line.lower() for line in done.errors.get(first, []))
        if not taken:
            return StageResult(name, False, done.failure(first))
        if attempt == PORT_ATTEMPTS - 1:
            return StageResult(name, False, "; ".join(done.errors[first]))
        reporter.note(f"port {port + attempt} is in use on {first}: trying {port + attempt + 1}")
    raise AssertionError("unreachable")


def _detail(run: LinkRun) -> str:
    return f"{run.sizes} sizes, {run.gbps:.2g} GB/s between {' and '.join(run.hosts)}"
