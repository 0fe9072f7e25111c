"""Communication profiler: all-reduce time per message size.

``intra``: ``nprocs`` processes on this node (gloo on the CPU, NCCL on GPUs).
``inter``: the same on every node, started with ``rank``/``world``/``master``
on each; the processes of all nodes form one group of ``nprocs * world``.

Each line of ``<kind>_comm_profile_data.txt`` is ``ideal_ms,measured_ms`` for
one message size, sizes increasing: ``ideal_ms = 2 (n-1)/n * size / bandwidth``
(the bandwidth-only ring all-reduce time, with the server's
``intra_bandwidth`` or ``inter_bandwidth`` and ``n`` the number of
processes), ``measured_ms`` the median all-reduce time
(:mod:`jabascli.profiler.comm_worker`). The side file
``<kind>_comm_profile_meta.json`` records that bandwidth, ``n``, the backend
and the sizes, so that the performance model never fits a profile taken at
one bandwidth to predictions made at another. (The seed used ``4 (n-1)/n``
and recorded neither.)

Every node of an inter-node run writes the same profile, so that a node that
already has one skips the run on all nodes alike; a node that skips while the
others measure leaves them waiting until the rendezvous times out. Same means
byte for byte: every rank ends with the same numbers, and the bandwidth behind
an inter-node ``ideal_ms`` is the lowest ``inter_bandwidth`` of the job's
servers on every node (what the slowest link allows), so nodes sharing one
profile folder may write it in any order. The meta file also records
``hosts``, every rank's address (where its gloo listens), so an inter-node
profile says between which machines it was measured (``127.0.0.1`` for each
rank of ``jabas profile all`` on one machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.config.loader import LoadedConfig
from jabascli.errors import InputError, RuntimeFailure
from jabascli.net import free_port
from jabascli.profiler.child import ChildCrashed, port_taken, run_group
from jabascli.profiler.common import Reporter, Target, ensure_writable, positive, resolve_target
from jabascli.profiles.formats import (
    BUCKET_MB,
    CommKind,
    CommMeta,
    CommProfile,
    comm_profile_path,
    read_comm_profile,
    ring_allreduce_ideal_ms,
    write_comm_profile,
)

WORKER_MODULE = "jabascli.profiler.comm_worker"
AFTER_WAIT_MS = 2.0
"""gloo: also time all-reduces that the last rank enters this long after the others, who wait blocked."""


@dataclass
class CommRun:
    target: Target
    folder: Path
    profile: CommProfile
    path: Path
    skipped: bool = False
    spread: list[tuple[float, float]] | None = None
    """Quartiles ``(p25, p75)`` of each size's measured time (ms), when measured now."""


def parse_sizes(text: str) -> list[float]:
    """Message sizes in MB (MiB): ``LO:HI`` doubles from LO and ends at HI; ``a,b,c`` lists them."""
    what = "--sizes"
    try:
        if ":" in text:
            lo_text, hi_text = text.split(":")
            lo, hi = float(lo_text), float(hi_text)
            if not (lo > 0 and hi >= lo and math.isfinite(hi)):
                raise InputError.at(None, what, f"expected 0 < LO <= HI, got {text!r}")
            sizes = []
            size = lo
            while size < hi:
                sizes.append(size)
                size *= 2
            sizes.append(hi)
        else:
            sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError.at(None, what, f"expected LO:HI or a comma list of sizes in MB, got {text!r}") from None
    sizes = sorted(set(sizes))
    if any(not (s > 0 and math.isfinite(s)) for s in sizes):
        raise InputError.at(None, what, f"sizes must be positive, got {text!r}")
    if len(sizes) < 2:
        raise InputError.at(None, what, f"give at least two sizes, so that time can be fitted against size: {text!r}")
    return sizes


def profile_comm(
    loaded: LoadedConfig,
    *,
    server: str | None = None,
    out: Path | None = None,
    sizes: str = "1:150",
    nprocs: int | None = None,
    rank: int | None = None,
    world: int | None = None,
    master: str | None = None,
    warmup: int = 3,
    reps: int | None = None,
    seconds_per_size: float = 1.0,
    backend: str | None = None,
    force: bool = False,
    timeout: float = 3600.0,
    rendezvous_timeout: float = 300.0,
    reporter: Reporter | None = None,
    loopback_nodes: int | None = None,
) -> CommRun:
    """Measure all-reduce time for every size and write the intra- or inter-node profile.

    ``loopback_nodes``: an inter-node profile of that many "nodes" on this
    machine, one process each, all started here and meeting on 127.0.0.1
    (``jabas profile all`` for a config whose servers all run here). A port
    taken before the rendezvous binds it is replaced by another.
    """
    reporter = reporter or Reporter()
    sizes_mb = parse_sizes(sizes)
    target = resolve_target(loaded, server, threads=1)
    inter = loopback_nodes is not None or any(v is not None for v in (rank, world, master))
    kind: CommKind = "inter" if inter else "intra"
    if loopback_nodes is not None:
        if loopback_nodes < 2:
            raise InputError.at(None, "servers", f"an inter-node profile needs at least 2 nodes, got {loopback_nodes}")
        addr, port, rank, nodes, nprocs = "127.0.0.1", free_port(), 0, loopback_nodes, 1
    elif inter:
        if rank is None or world is None or master is None:
            raise InputError.at(None, "--rank/--world/--master", "an inter-node profile needs all three")
        if world < 2:
            raise InputError.at(None, "--world", f"an inter-node profile needs at least 2 nodes, got {world}")
        if not 0 <= rank < world:
            raise InputError.at(None, "--rank", f"must be in 0..{world - 1}, got {rank}")
        addr, port = parse_master(master)
        nodes = world
    else:
        addr, port, rank, nodes = "127.0.0.1", free_port(), 0, 1
    local = nprocs if nprocs is not None else (target.server.devices if target.server.devices > 1 or inter else 2)
    positive(local, "--nprocs")
    if not inter and local < 2:
        raise InputError.at(None, "--nprocs", f"an intra-node profile needs at least 2 processes, got {local}")
    if warmup < 0:
        raise InputError.at(None, "--warmup", f"must be 0 or more, got {warmup}")
    if reps is not None:
        positive(reps, "--reps")
    backend = backend or ("nccl" if target.kind == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise InputError.at(None, "--backend", f"expected 'gloo' or 'nccl', got {backend!r}")
    folder = ensure_writable(Path(out) if out is not None else loaded.profile_dirs().communication)
    path = comm_profile_path(folder, kind)
    if path.is_file() and not force:
        existing = read_comm_profile(folder, kind)
        assert existing is not None
        reporter.note(f"{kind}-node profile already measured ({path})")
        return CommRun(target, folder, existing, path, skipped=True)

    world_size = local * nodes
    bandwidth = target.server.intra_bandwidth
    if inter:
        bandwidth = min(s.inter_bandwidth for s in (loaded.config.available() or [target.server]))
    sizes_bytes = [max(4, round(mb * BUCKET_MB / 4) * 4) for mb in sizes_mb]
    base = {
        "world_size": world_size,
        "backend": backend,
        "master_addr": addr,
        "master_port": port,
        "sizes_bytes": sizes_bytes,
        "warmup": warmup,
        "reps": reps,
        "seconds_per_size": seconds_per_size,
        "min_reps": 5,
        "max_reps": 200,
        "threads": 1,
        "timeout": rendezvous_timeout,
        "after_wait_ms": AFTER_WAIT_MS if backend == "gloo" else None,
    }
    here = range(world_size) if loopback_nodes is not None else range(rank * local, rank * local + local)
    specs = [{**base, "rank": r, "local_rank": r - here[0]} for r in here]

    def on_progress(fields: dict[str, Any]) -> None:
        done = int(fields.get("done", 0))
        size = fields.get("size_bytes", 0) / BUCKET_MB
        took = fields.get("median_ms", 0.0)
        reporter.progress(done, len(sizes_bytes), f"{kind}: {size:g} MB all-reduce took {took:.2f} ms")

    reporter.progress(0, len(sizes_bytes), f"{kind}: {world_size} processes ({backend}) meeting at {addr}:{port}")
    ours = addr == "127.0.0.1" and (loopback_nodes is not None or not inter)  # this process picked the port

    def moved(new: int) -> None:
        nonlocal port
        port = new
        reporter.note(f"{kind}: port in use, meeting at {addr}:{port} instead")

    try:
        results = run_group(
            WORKER_MODULE,
            lambda at: [{**spec, "master_port": at} for spec in specs],
            port,
            on_progress,
            timeout,
            on_new_port=moved if ours else None,
        )
    except ChildCrashed as crash:
        where = f" (port {port} on {addr} is in use: give another with --master)" if port_taken(crash) else ""
        raise RuntimeFailure(
            [f"all-reduce measurement ({kind}, {backend}) failed: {crash.describe()}{where}"]
        ) from None
    rows = results[0]["rows"]
    ideal = [ring_allreduce_ideal_ms(row["size_bytes"], bandwidth, world_size) for row in rows]
    measured = [row["median"] for row in rows]
    after_wait = [row["after_wait"] for row in rows] if all("after_wait" in row for row in rows) else None
    meta = CommMeta(
        bandwidth=bandwidth,
        world_size=world_size,
        backend=backend,
        sizes_bytes=[row["size_bytes"] for row in rows],
        after_wait_ms=after_wait,
        hosts=results[0].get("hosts"),
    )
    profile = CommProfile(kind=kind, ideal_ms=ideal, measured_ms=measured, meta=meta)
    written = write_comm_profile(folder, profile)
    for row in rows:
        reporter.note(
            f"{kind}: {row['size_bytes'] / BUCKET_MB:g} MB in {row['median']:.3f} ms "
            f"(p25 {row['p25']:.3f}, p75 {row['p75']:.3f}, {row['reps']} reps)"
        )
    return CommRun(target, folder, profile, written, spread=[(row["p25"], row["p75"]) for row in rows])


def profile_hosts(profile: CommProfile) -> list[str] | None:
    """Every rank's address when the profile was measured (its meta file's ``hosts``), or None."""
    hosts = (profile.meta.model_extra or {}).get("hosts") if profile.meta is not None else None
    return [str(h) for h in hosts] if isinstance(hosts, list) else None


def parse_master(master: str) -> tuple[str, int]:
    host, sep, port_text = master.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InputError.at(None, "--master", f"expected ADDR:PORT of the rank-0 node, got {master!r}")
    return host.strip("[]"), int(port_text)
