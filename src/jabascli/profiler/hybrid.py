"""The hybrid planner's profiles of a job's own workload (``jabas profile hybrid``, ``jabas profile all --hybrid``).

Writes ``<profiles>/hybrid/<workload>/blocks.json``, ``device-<type>.json`` per device type of the servers here and
``<profiles>/hybrid/network.json`` (docs/formats.md, "Hybrid profiles"), from two measurements in child processes
(:mod:`.hybrid_worker`):

* **blocks**, once per kind of device here (the CPU, or the GPU): per block ``f_i, g_i`` forward and backward
  seconds at every micro-batch size; the embeddings' part of the iteration is added to the first block and the
  head's and the loss's to the last (a pipeline's first and last stages hold them); ``u_i`` is the optimizer step
  shared by parameter bytes; parameter, activation and output bytes per block; optimizer state bytes per parameter
  byte; then each block again with every block checkpointed, as the runtime checkpoints it. On a CPU each op is
  timed after 2 ms idle (in a layout every op follows a wait; :mod:`.hybrid_worker`). An emulated server's device
  type is measured running the engine's emulation (every block sleeps ``slowdown - 1`` times its CPU time after its
  forward and backward; the update is not slowed): that costs more than ``slowdown`` times the CPU's times;
* **collectives**, two gloo processes on loopback: all-reduce, all-gather, reduce-scatter and send by size, kept
  as measured (``network.json``: ``collectives``); the bandwidth fit of every device type (``intra`` and ``inter``,
  2 devices) is the all-reduce's bus bandwidth ``2 (n-1)/n S / t`` fitted as ``polyval(c, log2(S / 1e6))`` GB/s
  (degree 2) under the largest measured. Servers on one machine reach each other over loopback: ``inter`` is the
  same fit;
* **the link between two nodes** (:func:`measure_link`, run on each of the two, one rank each): the same
  collectives across the link; :func:`write_link` makes them the profiles' ``inter`` link (rows and fits), so that
  the planner prices what crosses between servers on the real link.

TP degree 2, where the workload declares a TP plan that splits its blocks in two, is **measured**: two processes of a
gloo (NCCL on two GPUs) group on this machine run the same timed iterations with every block split across them, so
each block's forward and backward include its all-reduces and whatever the two ranks cost each other (on a CPU they
share its cores and memory). Per block, the slower rank's median. An emulated device's TP time is ``T + (s - 1) c``:
the measured time plus ``s - 1`` times the block's CPU time on the rank's thread, which is what the engine's emulation
sleeps. With one GPU here, TP 2 is derived instead (the profile says so): per block ``f_i / 2 + 2 AR(b O_i)`` and
``g_i / 2 + 2 AR(b O_i)`` (Megatron's two all-reduces of the block's activations forward and two backward, at the
measured all-reduce). Memory under TP 2 is derived either way: the block's own parameters and its activations halved,
the embeddings and head whole.

Sharded data parallelism (``sharding = "full"``) is measured the same way (``sharded`` in the device profile): two
processes hold every block and then the model as FSDP2 units, as the runtime does, and each iteration runs two
micro-batches (the first pays each unit's all-gather in its forward, the last its reduce-scatter in its backward,
the parameters stay gathered between) and the optimizer step on the shards. Per block the slower rank's medians;
an emulated device is measured with both ranks running its emulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from jabascli.atomic import atomic_write_json
from jabascli.config import LoadedConfig
from jabascli.errors import InputError, RuntimeFailure
from jabascli.inputs import read_json
from jabascli.profiler.child import ChildCrashed, run_child, run_group
from jabascli.profiler.common import Reporter, ensure_writable, job_workload, resolve_target, servers_here
from jabascli.profiles.hybrid import (
    BandwidthFit,
    BlockInfo,
    CollectiveTime,
    DeviceTimes,
    HybridProfiles,
    ModelBlocks,
    Network,
    ShardedTimes,
    blocks_file,
    device_file,
    model_dir,
    network_file,
    write_profiles,
)

WORKER = "jabascli.profiler.hybrid_worker"
MBS = (1, 2, 4, 8)
SIZES_BYTES = tuple(4**k * 1024 for k in range(0, 7))
"""1 KiB to 4 MiB: from a tiny model's activations to a small one's gradients."""


@dataclass
class HybridRun:
    model: str
    written: list[Path]
    devices: list[str]
    skipped: bool = False


def profile_hybrid(
    loaded: LoadedConfig,
    *,
    out: Path | None = None,
    mbs: tuple[int, ...] = MBS,
    force: bool = False,
    reporter: Reporter | None = None,
) -> HybridRun:
    """Measure and write the hybrid profiles of the job's workload on the servers of this machine."""
    reporter = reporter or Reporter()
    workload, spec = job_workload(loaded)
    if not callable(getattr(workload.module, "blocks", None)):
        raise InputError.at(
            workload.path, "blocks", "the hybrid planner needs the workload's blocks (docs/workloads.md)"
        )
    mine, elsewhere = servers_here(loaded)
    if elsewhere or not mine:
        names = ", ".join(s.name for s in elsewhere) or "none here"
        raise InputError.at(
            loaded.path, "cluster.servers", f"hybrid profiles measure servers on this machine ({names})"
        )
    root = ensure_writable(out or loaded.config.profiles.dir or loaded.folder / "profiles")
    folder = model_dir(root, workload.name)
    types = sorted({s.device_type for s in mine})
    if not force and blocks_file(folder).is_file() and all(device_file(folder, t).is_file() for t in types):
        reporter.note(f"hybrid profiles already measured ({folder})")
        return HybridRun(workload.name, [], types, skipped=True)
    targets = {t: resolve_target(loaded, next(s for s in mine if s.device_type == t).name) for t in types}
    measured: dict[tuple[str, int | None], dict[str, Any]] = {}
    emulated: dict[str, dict[str, Any]] = {}
    for t in types:
        key = (targets[t].device, targets[t].threads)
        if key not in measured:
            reporter.progress(0, len(mbs), f"blocks on {targets[t].describe()}")
            measured[key] = _blocks(spec, key, mbs, reporter)
    for t in types:
        if targets[t].slowdown != 1.0:
            reporter.progress(0, len(mbs), f"blocks on {targets[t].describe()}")
            emulated[t] = _blocks(spec, (targets[t].device, targets[t].threads), mbs, reporter, targets[t].slowdown)
    network, allreduce = _collectives(types, reporter)
    first = next(iter(measured.values()))
    tp2 = callable(getattr(workload.module, "tp_plan", None))
    split: dict[tuple[str, int | None], dict[str, Any] | None] = {}
    if tp2:
        for key in measured:
            split[key] = _tp_blocks(spec, key, mbs, reporter) if _can_measure_tp2(key[0]) else None
        tp2 = all(result is None or result.get("status") == "ok" for result in split.values())
    sharded = {key: _shard_blocks(spec, key, mbs, reporter) for key in measured if _can_measure_tp2(key[0])}
    sharded_emulated = {
        t: _shard_blocks(spec, (targets[t].device, targets[t].threads), mbs, reporter, targets[t].slowdown)
        for t in emulated
        if _can_measure_tp2(targets[t].device)
    }
    blocks = _model_blocks(workload.name, first, tp2)
    devices = {}
    for t in types:
        target = targets[t]
        server = next(s for s in mine if s.device_type == t)
        key = (target.device, target.threads)
        tp_times = split.get(key) if tp2 else None
        times = _device_times(measured[key], target.slowdown, tp2, tp_times, allreduce, first, emulated.get(t))
        checkpointed = _checkpointed_times(emulated.get(t) or measured[key], target.slowdown, emulated=t in emulated)
        if t in sharded_emulated:
            shard_rows = _sharded_times(sharded_emulated[t], target.slowdown, first["params_bytes"], emulated=True)
        elif key in sharded:
            shard_rows = _sharded_times(sharded[key], target.slowdown, first["params_bytes"])
        else:
            shard_rows = {}
        devices[t] = DeviceTimes(
            device=t,
            source=_source(target.describe(), tp2, measured_tp=tp_times is not None)
            + ("; sharded (FSDP2) over 2 measured on two processes" if key in sharded else ""),
            memory_bytes=float(target.memory_bytes),
            devices_per_server=server.devices,
            times=times,
            checkpointed=checkpointed,
            sharded=shard_rows,
        )
    profiles = HybridProfiles(blocks=blocks, devices=devices, network=network)
    written = write_profiles(root, profiles)
    return HybridRun(workload.name, written, types)


def _source(device: str, tp2: bool, *, measured_tp: bool) -> str:
    if not tp2:
        return f"jabas profile hybrid on {device}"
    how = "TP 2 measured on two processes" if measured_tp else "TP 2 derived from TP 1 and the measured all-reduce"
    return f"jabas profile hybrid on {device}; {how}"


def _can_measure_tp2(device: str) -> bool:
    """Two CPU processes always; two GPUs only where there are two."""
    if device != "cuda":
        return True
    import torch

    return torch.cuda.device_count() >= 2


def _tp_blocks(spec: dict[str, Any], key: tuple[str, int | None], mbs: tuple[int, ...], reporter: Reporter) -> dict:
    """The blocks timed split over a TP group of 2 (two processes); per block the slower rank's times.

    ``status`` is ``skip`` where the workload's TP plan cannot split its blocks in two (then no plan uses TP 2).
    """
    return _two_ranks(spec, key, mbs, reporter, "tp", "TP 2")


def _shard_blocks(
    spec: dict[str, Any], key: tuple[str, int | None], mbs: tuple[int, ...], reporter: Reporter, slowdown: float = 1.0
) -> dict:
    """The blocks timed as FSDP2 units sharded over 2 data-parallel ranks (two processes); per block the slower
    rank's times. ``slowdown`` > 1: both ranks' blocks run the engine's emulation."""
    return _two_ranks({**spec, "slowdown": slowdown}, key, mbs, reporter, "shard", "sharded over 2")


def _two_ranks(
    spec: dict[str, Any], key: tuple[str, int | None], mbs: tuple[int, ...], reporter: Reporter, how: str, what: str
) -> dict:
    device, threads = key
    base = {"kind": "blocks", **spec, "device": device, "threads": threads, "mbs": list(mbs), how: 2}
    base |= {"world_size": 2, "master_addr": "127.0.0.1", "min_reps": 5}

    def progress(fields: dict[str, Any]) -> None:
        reporter.progress(fields.get("done", 0), len(mbs), f"blocks, {what}: micro-batch size {fields.get('mbs')}")

    results = _pair(base, progress, 600, f"hybrid {what} block profile")
    if any(r.get("status") == "skip" for r in results):
        return {"status": "skip"}
    slower: dict[str, Any] = {}
    for b, mine in results[0]["times"].items():
        other = results[1]["times"][b]
        slower[b] = {k: _max(v, other[k]) for k, v in mine.items()}
    return {"status": "ok", "times": slower}


def _pair(base: dict[str, Any], progress: Any, timeout: float, what: str) -> list[dict[str, Any]]:
    """Ranks 0 and 1 of ``base``'s measurement, two processes meeting on loopback at a free port; their results."""
    try:
        return run_group(
            WORKER, lambda port: [{**base, "rank": r, "master_port": port} for r in (0, 1)], None, progress, timeout
        )
    except ChildCrashed as crash:
        raise RuntimeFailure([f"{what} failed: {crash.describe()}"]) from None


def _max(a: Any, b: Any) -> Any:
    return [max(x, y) for x, y in zip(a, b, strict=True)] if isinstance(a, list) else max(a, b)


def _blocks(
    spec: dict[str, Any], key: tuple[str, int | None], mbs: tuple[int, ...], reporter: Reporter, slowdown: float = 1.0
) -> dict:
    """The blocks timed on one device (module docstring); ``slowdown`` > 1: every block running the engine's
    emulation of a device that much slower."""
    device, threads = key

    def progress(fields: dict[str, Any]) -> None:
        reporter.progress(fields.get("done", 0), len(mbs), f"blocks: micro-batch size {fields.get('mbs')}")

    job = {"kind": "blocks", **spec, "device": device, "threads": threads, "mbs": list(mbs), "slowdown": slowdown}
    try:
        result = run_child(WORKER, job, progress, timeout=600)
    except ChildCrashed as crash:
        raise RuntimeFailure([f"hybrid block profile failed: {crash.describe()}"]) from None
    if result.get("status") != "ok":
        raise RuntimeFailure([f"hybrid block profile failed: {result.get('error')}"])
    return result


def _collectives(types: list[str], reporter: Reporter) -> tuple[Network, BandwidthFit]:
    """Two gloo processes on loopback; the all-reduce's bandwidth fit for every device type."""
    base = {"kind": "collectives", "world_size": 2, "master_addr": "127.0.0.1", "sizes_bytes": list(SIZES_BYTES)}

    def progress(fields: dict[str, Any]) -> None:
        reporter.progress(fields.get("done", 0), len(SIZES_BYTES), f"collectives: {fields.get('size_bytes')} bytes")

    results = _pair(base, progress, 300, "hybrid collective profile")
    # the servers share this machine: what crosses between them is what was measured here
    rows = [CollectiveTime(devices=2, link=link, **row) for link in ("intra", "inter") for row in results[0]["rows"]]
    ring = [r for r in rows if r.collective == "all_reduce"]
    fit = bus_bandwidth_fit([r.size_bytes for r in ring], [r.seconds for r in ring], 2)
    table = {t: {2: fit} for t in types}
    source = "jabas profile hybrid: gloo, 2 processes on loopback (inter = intra: the servers share this machine)"
    return Network(source=source, intra=table, inter=table, collectives=rows), fit


@dataclass(frozen=True)
class MeasuredLink:
    """What :func:`measure_link` measured: the rows (``link = "inter"``) and every rank's address, by rank."""

    rows: list[CollectiveTime]
    hosts: list[str]


def measure_link(
    rank: int,
    master_addr: str,
    master_port: int,
    *,
    reporter: Reporter | None = None,
    sizes_bytes: tuple[int, ...] = SIZES_BYTES,
    timeout_s: float = 600.0,
) -> MeasuredLink:
    """One of the two processes of a measurement of the link between two nodes: run on each node, ``rank`` 0 on the
    node whose address is ``master_addr`` (its store listens there), ``rank`` 1 on the other. The collectives of
    :func:`_collectives` (all-reduce, all-gather, reduce-scatter and send by size, gloo) then cross the link; both
    ranks return the same rows (each the slower rank's median), ``link = "inter"``, and both nodes' addresses.
    ``sizes_bytes``: the sizes measured (default 1 KiB to 4 MiB; on a slow link the largest take seconds each)."""
    reporter = reporter or Reporter()
    spec = {
        "kind": "collectives",
        "world_size": 2,
        "rank": rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "sizes_bytes": list(sizes_bytes),
        "timeout": timeout_s,
    }

    def progress(fields: dict[str, Any]) -> None:
        reporter.progress(fields.get("done", 0), len(sizes_bytes), f"link: {fields.get('size_bytes')} bytes")

    try:
        result = run_child(WORKER, spec, progress, timeout=timeout_s, fresh=True)
    except ChildCrashed as crash:
        raise RuntimeFailure([f"hybrid link profile (rank {rank}) failed: {crash.describe()}"]) from None
    if result.get("status") != "ok":
        raise RuntimeFailure([f"hybrid link profile (rank {rank}) failed: {result.get('error')}"])
    rows = [CollectiveTime(devices=2, link="inter", **row) for row in result["rows"]]
    return MeasuredLink(rows, [str(h) for h in result.get("hosts", [])])


def link_network(network: Network, rows: list[CollectiveTime], source: str) -> Network:
    """``network`` with its ``inter`` link as measured between two nodes (:func:`measure_link`): the rows as they
    are, and every device type's ``inter`` fit the all-reduce's bus bandwidth over them, for one device of a server
    (each node ran one process)."""
    ring = sorted((r for r in rows if r.collective == "all_reduce"), key=lambda r: r.size_bytes)
    if len(ring) < 2:
        raise InputError.at(None, "link", f"{len(ring)} all-reduce sizes measured on the link: a fit needs 2")
    fit = bus_bandwidth_fit([r.size_bytes for r in ring], [r.seconds for r in ring], 2)
    return network.with_link("inter", rows, fit, 1, source)


def write_link(root: Path, rows: list[CollectiveTime], source: str) -> Path:
    """Replace the ``inter`` link of ``<root>/hybrid/network.json`` (``jabas profile hybrid`` wrote it) by ``rows``
    measured between two nodes (:func:`link_network`), atomically; the path."""
    path = network_file(root)
    return atomic_write_json(path, link_network(read_network(path), rows, source).model_dump(mode="json"))


def read_network(path: Path) -> Network:
    """The hybrid network profile at ``path``; InputError naming the file when it is missing or not one."""
    try:
        return Network.model_validate(read_json(path))
    except ValidationError as err:
        raise InputError.at(path, None, f"not a hybrid network profile: {err.errors()[0]['msg']}") from None


def bus_bandwidth_fit(sizes: list[float], seconds: list[float], n: int) -> BandwidthFit:
    """``bw(S) = polyval(c, log2(S / 1e6))`` GB/s through the ring all-reduce's bus bandwidth, capped at the
    largest measured."""
    bus = [2 * (n - 1) / n * s / max(t, 1e-9) for s, t in zip(sizes, seconds, strict=True)]
    x = np.log2(np.array(sizes) / 1e6)
    coeffs = np.polyfit(x, np.array(bus) / 1e9, min(2, len(sizes) - 1))
    return BandwidthFit(coeffs=[float(c) for c in coeffs], cap=max(bus))


def _model_blocks(model: str, measured: dict[str, Any], tp2: bool) -> ModelBlocks:
    params, acts, out = measured["params_bytes"], measured["act_bytes"], measured["boundary_bytes"]
    own = measured["own_params_bytes"]
    blocks = []
    for i, (p, a, o) in enumerate(zip(params, acts, out, strict=True)):
        by_tp_p, by_tp_a = {1: float(p)}, {1: float(a)}
        if tp2:  # the block's own parameters and activations split over the TP group; embeddings and head whole
            by_tp_p[2], by_tp_a[2] = p - own[i] / 2, a / 2
        blocks.append(BlockInfo(name=str(i), params_bytes=by_tp_p, act_bytes=by_tp_a, boundary_bytes=float(o)))
    return ModelBlocks(
        model=model,
        source="jabas profile hybrid",
        optimizer_bytes_per_param_byte=float(measured["optimizer_bytes_per_param_byte"]),
        step_bytes_per_param_byte=float(measured["step_bytes_per_param_byte"]),
        output_bytes=float(measured["output_bytes"]),
        microbatch_buffers=True,
        blocks=blocks,
    )


def _device_times(
    measured: dict[str, Any],
    slowdown: float,
    tp2: bool,
    tp_measured: dict[str, Any] | None,
    allreduce: BandwidthFit,
    sizes: dict[str, Any],
    emulated: dict[str, Any] | None = None,
) -> dict[int, dict[int, list[tuple[float, float, float]]]]:
    """Per micro-batch size and TP degree, per block (forward, backward, update). An emulated device's TP 1 blocks
    are ``emulated``'s, measured running the emulation; the embeddings and head ``slowdown`` times the CPU's."""
    params = measured["params_bytes"]
    out = sizes["boundary_bytes"]
    times: dict[int, dict[int, list[tuple[float, float, float]]]] = {}
    for b_text, t in measured["times"].items():
        b = int(b_text)
        blocks = t if emulated is None else emulated["times"][b_text]  # the emulated: running the emulation
        scale = slowdown if emulated is None else 1.0
        update = [t["update"] * p / sum(params) for p in params]
        fwd, bwd = [scale * f for f in blocks["fwd"]], [scale * g for g in blocks["bwd"]]
        _add_ends(fwd, bwd, t, slowdown)
        rows = {1: list(zip(fwd, bwd, update, strict=True))}
        if tp_measured is not None:
            rows[2] = _measured_tp(tp_measured["times"][b_text], slowdown, params)
        elif tp2:
            ar = [2 * allreduce.seconds(b * o) for o in out]
            half_f, half_g = [scale * f / 2 for f in blocks["fwd"]], [scale * g / 2 for g in blocks["bwd"]]
            _add_ends(half_f, half_g, t, slowdown)
            rows[2] = [(f + a, g + a, u / 2) for f, g, u, a in zip(half_f, half_g, update, ar, strict=True)]
        times[b] = rows
    return times


def _add_ends(fwd: list[float], bwd: list[float], t: dict[str, Any], slowdown: float) -> None:
    """Add the embeddings' forward and backward to the first block, the head's and the loss's to the last (the
    pipeline stages that hold them), ``slowdown`` times the CPU's (the emulation slows the blocks only)."""
    fwd[0] += slowdown * t["embed"][0]
    bwd[0] += slowdown * t["embed"][1]
    fwd[-1] += slowdown * t["head"][0]
    bwd[-1] += slowdown * t["head"][1]


def _checkpointed_times(
    measured: dict[str, Any], slowdown: float, *, emulated: bool
) -> dict[int, list[tuple[float, float]]]:
    """Per block (forward, backward with its recompute) with every block checkpointed, at TP 1; the embeddings
    and head (never checkpointed) as in the plain rows. ``emulated``: measured running the emulation."""
    scale = 1.0 if emulated else slowdown
    out: dict[int, list[tuple[float, float]]] = {}
    for b_text, t in measured["times"].items():
        if "fwd_ckpt" not in t:
            return {}
        fwd, bwd = [scale * f for f in t["fwd_ckpt"]], [scale * g for g in t["bwd_ckpt"]]
        _add_ends(fwd, bwd, t, slowdown)
        out[int(b_text)] = list(zip(fwd, bwd, strict=True))
    return out


def _measured_tp(t: dict[str, Any], slowdown: float, params: list[float]) -> list[tuple[float, float, float]]:
    """Per block (forward, backward, update) under TP 2 from its measurement: ``T + (s - 1) c`` per block (module
    docstring), the embeddings and head (whole on every rank) times ``s``, the measured update shared by bytes."""
    extra = slowdown - 1.0
    fwd = [f + extra * c for f, c in zip(t["fwd"], t["fwd_cpu"], strict=True)]
    bwd = [g + extra * c for g, c in zip(t["bwd"], t["bwd_cpu"], strict=True)]
    _add_ends(fwd, bwd, t, slowdown)
    update = [t["update"] * p / sum(params) for p in params]
    return list(zip(fwd, bwd, update, strict=True))


def _sharded_times(
    measured: dict[str, Any], slowdown: float, params: list[float], *, emulated: bool = False
) -> dict[int, list[ShardedTimes]]:
    """Per block the sharded times as an emulated device of ``slowdown`` runs them: measured running the emulation
    (``emulated``), else ``T + (s - 1) c`` per measured time (as for TP 2: the engine sleeps ``s - 1`` times the CPU
    time of the work, FSDP2's hooks included); the embeddings' and head's (with the root unit's gather and
    reduce-scatter) added to the first and last block; the update shared by parameter bytes, not slowed."""
    extra = 0.0 if emulated else slowdown - 1.0
    out: dict[int, list[ShardedTimes]] = {}
    for b_text, t in measured["times"].items():
        n = len(t["fwd"])

        def slowed(name: str, t: dict[str, Any] = t) -> list[float]:
            return [w + extra * c for w, c in zip(t[name], t[f"{name}_cpu"], strict=True)]

        f_first, f_rest, g_rest, g_last = slowed("fwd_first"), slowed("fwd"), slowed("bwd"), slowed("bwd_last")
        _add_ends(f_rest, g_rest, t, slowdown)
        _add_ends(f_first, g_last, t, slowdown)
        # the root unit's gather runs in the first forward, its reduce-scatter in the last backward
        f_first[0] += t["embed_once"][0]
        g_last[0] += t["embed_once"][1]
        f_first[n - 1] += t["head_once"][0]
        g_last[n - 1] += t["head_once"][1]
        total = sum(params)
        out[int(b_text)] = [
            ShardedTimes(fwd_first=ff, fwd=f, bwd=g, bwd_last=gl, update=t["update"] * p / total)
            for ff, f, g, gl, p in zip(f_first, f_rest, g_rest, g_last, params, strict=True)
        ]
    return out
