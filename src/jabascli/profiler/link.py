"""``jabas profile link``: the link between two nodes, measured for the hybrid planner.

``jabas profile hybrid`` measures on one machine, where the servers reach each other over loopback, so the
``inter`` link of ``<profiles>/hybrid/network.json`` it writes is loopback's. :func:`profile_link` runs on each of two
nodes at once, one process each (:func:`.hybrid.measure_link`: rank 0 on the node at ``--master``'s address, where
its store listens, rank 1 on the other): the same gloo collectives then cross the link between them. Rank 0 writes
the rows as the profiles' ``inter`` link (:func:`.hybrid.write_link`, atomically), its source naming both nodes'
addresses (``jabas profile link: gloo between ADDR0 and ADDR1``), which :func:`link_on_disk` reads back. Rank 1
writes nothing. ``jabas profile all`` on a cluster runs both sides itself (:mod:`.remote_link`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.hybrid.job import profiles_root
from jabascli.profiler.common import Reporter, ensure_writable
from jabascli.profiler.hybrid import bus_bandwidth_fit, measure_link, read_network, write_link
from jabascli.profiles.hybrid import CollectiveTime, network_file

LINK_SOURCE = "jabas profile link"
"""How the ``inter`` link's source begins in ``network.json`` once :func:`profile_link` measured it."""
MAX_KIB = 4096
"""The largest message measured by default (KiB): sizes from 1 KiB, 4x each, to 4 MiB."""


@dataclass(frozen=True)
class LinkRun:
    rank: int
    hosts: list[str]
    """Both nodes' addresses, rank 0's first."""
    rows: list[CollectiveTime]
    path: Path | None
    """The ``network.json`` rank 0 wrote; None on rank 1."""

    @property
    def sizes(self) -> int:
        return len({r.size_bytes for r in self.rows})

    @property
    def gbps(self) -> float:
        """The all-reduce's bus bandwidth at the largest size measured, GB/s (the ``inter`` fit's cap)."""
        ring = sorted((r for r in self.rows if r.collective == "all_reduce"), key=lambda r: r.size_bytes)
        return bus_bandwidth_fit([r.size_bytes for r in ring], [r.seconds for r in ring], 2).cap / 1e9


def network_path(loaded: LoadedConfig, out: Path | None = None) -> Path:
    """Where ``jabas profile hybrid -c CONFIG`` writes the job's network profile: ``<profiles>/hybrid/network.json``."""
    return network_file(profiles_root(loaded, out))


def require_network(loaded: LoadedConfig, out: Path | None = None) -> Path:
    """The job's ``hybrid/network.json``, which must be on disk (the link is written into it); else InputError
    saying what to run."""
    path = network_path(loaded, out)
    if not path.is_file():
        raise InputError.at(
            path, None, f"no hybrid network profile: run `jabas profile hybrid -c {loaded.path}` first (on one machine)"
        )
    return path


def link_on_disk(path: Path) -> LinkRun | None:
    """The ``inter`` link of the network profile at ``path`` when :func:`profile_link` measured it (its source
    ``jabas profile link: gloo between ADDR0 and ADDR1``): its rows and the nodes' addresses; None otherwise
    (loopback's, as ``jabas profile hybrid`` wrote it, or imported)."""
    network = read_network(path)
    found = re.search(r"(?:^|; )inter: " + re.escape(LINK_SOURCE) + r": gloo between (.*)$", network.source)
    if found is None:
        return None
    rows = [r for r in network.collectives if r.link == "inter"]
    return LinkRun(0, found.group(1).split(" and "), rows, path)


def link_source(hosts: list[str]) -> str:
    return f"{LINK_SOURCE}: gloo between {' and '.join(hosts)}"


def link_sizes(max_kib: int) -> tuple[int, ...]:
    """1 KiB, 4 KiB, ... up to ``max_kib`` KiB (at least two sizes: the bandwidth fit needs two)."""
    sizes = tuple(4**k * 1024 for k in range(16) if 4**k <= max_kib)
    if len(sizes) < 2:
        raise InputError.at(None, "--max-kib", f"at least 4 (two sizes, 1 and 4 KiB, for a fit), got {max_kib}")
    return sizes


def profile_link(
    loaded: LoadedConfig,
    rank: int,
    master: str,
    *,
    out: Path | None = None,
    max_kib: int = MAX_KIB,
    timeout_s: float = 600.0,
    reporter: Reporter | None = None,
) -> LinkRun:
    """One side of the link measurement (module docstring); rank 0 checks the job's ``hybrid/network.json`` is
    there before measuring and writes the link into it after. ``out``: the profiles folder holding ``hybrid/``
    (default: the config's). ``timeout_s``: how long to wait for the other node and to measure."""
    from jabascli.profiler.comm import parse_master

    if rank not in (0, 1):
        raise InputError.at(None, "--rank", f"expected 0 (the node at --master's address) or 1, got {rank}")
    addr, port = parse_master(master)
    sizes = link_sizes(max_kib)
    if timeout_s <= 0:
        raise InputError.at(None, "--timeout", f"must be positive, got {timeout_s:g}")
    path = None
    if rank == 0:
        path = require_network(loaded, out)
        read_network(path)  # a bad file is named before anything is measured
        ensure_writable(path.parent)
    measured = measure_link(rank, addr, port, reporter=reporter, sizes_bytes=sizes, timeout_s=timeout_s)
    if path is not None:
        write_link(path.parent.parent, measured.rows, link_source(measured.hosts))
    return LinkRun(rank, measured.hosts, measured.rows, path)
