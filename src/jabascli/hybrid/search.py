"""The search: the fastest hybrid plan for a GBS on a set of servers of different device types.

Space searched (docs/hybrid-planner.md, "The search"):

* the LBS ``b`` (every micro-batch size profiled on all the device types used) with ``b | GBS``;
* **pipelines** of ``S`` stages (``S`` in ``stage_counts``): the stages are grouped by device type, consecutive
  stages on one type (every order of the types, every count of stages per type); each type used gets one TP degree
  ``t_d`` (its ``tp_candidates`` fastest); ``R = min_d floor(devices_d / (t_d k_d))`` identical replicas; the blocks
  per stage come from Galvatron's layerwise dynamic programming extended to stages on device types:
  ``f_s[j] = min_{i<j} max(f_{s-1}[i], sigma_s(i, j))``, where ``sigma_s(i, j)`` is the per-micro-batch time of stage
  ``s`` holding blocks ``i..j-1`` with the fewest checkpointed blocks that make it fit the device's memory (``inf``
  when none does), optimizer state sharded over the replicas when that is what fits;
* **plain IIDP**: ``S = 1``, one replica per ``t_d`` devices of every type used, each replica's micro-batch count
  chosen by water-filling (the next micro-batch goes to the replica that would finish it first, which minimises
  ``max_r M_r sigma_r`` exactly).

What is exact and what is pruned: for a fixed ``(b, S, types per stage, t_d)`` the DP minimises the bottleneck
``max_s sigma_s`` exactly (the ``(M-1) max`` term of the pipeline time), not ``sum_s sigma_s``; checkpointing counts
use the stage's average block; the ``tp_candidates`` fastest TP degrees per type are kept; replicas of one pipeline
plan are identical. Each candidate's best few are then priced by the full cost model (``CostModel.predict``), which
decides. ``tests/test_hybrid_search.py`` compares with a brute force over every split, checkpoint set, TP degree and
type order on small instances and bounds the loss.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel, Prediction
from jabascli.hybrid.plan import Placement, Plan, Replica, Sharding


def size(value: float) -> str:
    """``15.54 GB``, ``612.3 KB``: bytes in the unit that reads best."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}" if unit == "GB" else f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


@dataclass(frozen=True)
class ServerGroup:
    """``count`` servers of one device type (devices per server from the type's profile)."""

    device: str
    count: int


@dataclass
class Shortfall:
    """The layout closest to fitting, over every candidate that did not: its largest need against its device's
    memory, every block checkpointed (what a memory budget no plan fits is told in)."""

    ratio: float = math.inf
    need: float = 0.0
    device: str = ""
    budget: float = 0.0

    def offer(self, need: float, device: str, budget: float) -> None:
        if need / budget < self.ratio:
            self.ratio, self.need, self.device, self.budget = need / budget, need, device, budget


@dataclass(frozen=True)
class Choice:
    plan: Plan
    prediction: Prediction


def search(
    model: CostModel,
    servers: list[ServerGroup],
    gbs: int,
    *,
    stage_counts: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
    tp_candidates: int = 2,
    keep: int = 4,
    even_split: bool = False,
    deal: bool = False,
) -> Choice:
    """The fastest plan that fits every device's memory; ``InputError`` naming the smallest footprint if none.

    ``even_split``: every pipeline splits the blocks evenly over its stages (as Galvatron and most planners for
    one device type do), for comparisons. ``deal``: only plans whose every replica runs at least one micro-batch per
    device (the runtime deals a replica's micro-batches to its ranks, one at least each: ``jabas solve --hybrid``)."""
    devices = {g.device: 0 for g in servers}
    for g in servers:
        if g.device not in model.profiles.devices:
            have = ", ".join(sorted(model.profiles.devices))
            raise InputError.at(None, f"servers.{g.device}", f"no hybrid profile of this device type (have: {have})")
        devices[g.device] += g.count * model.profiles.devices[g.device].devices_per_server
    candidates: list[tuple[float, int, Callable[[], Plan | None]]] = []
    counter = itertools.count()
    smallest = Shortfall()

    def offer(estimate: float, plan: Callable[[], Plan | None]) -> None:
        candidates.append((estimate, next(counter), plan))

    for b in _lbs_values(model, list(devices), gbs):
        n_micro = gbs // b
        for estimate, plan in _iidp_plans(model, devices, b, n_micro, smallest, deal):
            offer(estimate, lambda plan=plan: plan)
        pipelines = _pipeline_plans(model, devices, b, n_micro, stage_counts, tp_candidates, smallest, even_split, deal)
        for estimate, plan in pipelines:
            offer(estimate, plan)
    # The ``keep`` best by estimate that fit once built (a stage's checkpoint set, or the full model's memory,
    # may say no where the DP's estimate said yes: the next ones are tried then, 16 per kept plan at most, so
    # that a budget nothing fits is told without building every candidate).
    choices: list[Choice] = []
    for _, _, build in sorted(candidates, key=lambda c: (c[0], c[1]))[: 16 * keep]:
        plan = build()
        choice = None if plan is None else Choice(plan, model.predict(plan))
        if choice is not None and choice.prediction.fits:
            choices.append(choice)
            if len(choices) == keep:
                break
    if not choices:
        if not _lbs_values(model, list(devices), gbs):
            raise InputError.at(None, "gbs", f"no plan at GBS {gbs}: no profiled micro-batch size divides it")
        if not smallest.device:  # every candidate was left out for dealing, none for memory
            raise InputError.at(
                None, "gbs", f"no plan at GBS {gbs} gives every device of a replica one micro-batch at least"
            )
        raise InputError.at(
            None,
            "memory",
            f"no plan fits the devices' memory at GBS {gbs}: the smallest footprint found needs "
            f"{size(smallest.need)} on a {smallest.device} device (every block checkpointed), "
            f"which has {size(smallest.budget)}",
        )
    # equally fast (to the nanosecond): the plan whose fullest device holds the least
    return min(choices, key=lambda c: (round(c.prediction.iteration_s, 9), c.prediction.max_peak_bytes))


def _lbs_values(model: CostModel, types: list[str], gbs: int) -> list[int]:
    common = set.intersection(*(set(model.profiles.devices[d].times) for d in types))
    return sorted(b for b in common if gbs % b == 0)


def _tps(model: CostModel, device: str, b: int, limit: int, keep: int) -> list[int]:
    """The ``keep`` TP degrees of ``device`` with the most samples per second per device (at most ``limit``)."""
    dev = model.profiles.devices[device]
    options = [t for t in dev.times.get(b, {}) if t <= min(limit, dev.devices_per_server)]
    rate = {t: b / (t * sum(f + g for f, g, _ in dev.times[b][t])) for t in options}
    return sorted(options, key=lambda t: -rate[t])[:keep]


def _water_fill(times: list[float], n: int) -> list[int]:
    """Micro-batches per replica minimising ``max_r M_r times[r]`` with ``sum M_r = n`` (greedy is exact here)."""
    counts = [0] * len(times)
    heap = [(t, r) for r, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(n):
        finish, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (finish + times[r], r))
    return counts


def _fitting_layout(
    model: CostModel,
    device: str,
    b: int,
    t: int,
    first: int,
    last: int,
    in_flight: int,
    shards: int,
    buffers: float = 0.0,
) -> tuple[float, frozenset[int]] | None:
    """Per-micro-batch compute of blocks ``first..last-1`` with the checkpoint set that makes them fit, or None.

    Blocks are checkpointed in order of activation bytes saved per second of recompute; ``buffers``: what the
    pipeline runtime keeps on the stage (:meth:`CostModel.pipeline_buffers`)."""
    budget = model.profiles.devices[device].memory_bytes
    extra = model.checkpoint_s(device, b, t)
    order = sorted(
        range(first, last),
        key=lambda i: -(model.blocks.activations(i, t) - model.blocks.blocks[i].boundary_bytes) / max(extra[i], 1e-9),
    )
    for k in range(len(order) + 1):
        ckpt = frozenset(order[:k])
        mem = model.stage_memory(device, b, t, first, last, ckpt, in_flight, shards, buffers)
        if mem <= budget:
            return model.stage_compute(device, b, t, first, last, ckpt), ckpt
    return None


def _iidp_plans(
    model: CostModel, devices: dict[str, int], b: int, n_micro: int, smallest: Shortfall, deal: bool = False
) -> list[tuple[float, Plan]]:
    """Plain IIDP: whole-model replicas on every device type used, micro-batch counts by water-filling."""
    n_blocks = model.profiles.num_blocks
    out = []
    types = list(devices)
    per_type = {d: _tps(model, d, b, devices[d], 4) for d in types}
    for used in _subsets(types):
        for tps in itertools.product(*(per_type[d] for d in used)):
            for sharding in ("none", "full"):
                shards = sum(devices[d] // t for d, t in zip(used, tps, strict=False)) if sharding == "full" else 1
                layouts = [
                    _fitting_layout(model, d, b, t, 0, n_blocks, 1, shards) for d, t in zip(used, tps, strict=False)
                ]
                if any(lay is None for lay in layouts):
                    for d, t in zip(used, tps, strict=False):
                        mem = model.stage_memory(d, b, t, 0, n_blocks, frozenset(range(n_blocks)), 1, shards)
                        smallest.offer(mem, d, model.profiles.devices[d].memory_bytes)
                    continue
                ckpt = frozenset().union(*(lay[1] for lay in layouts if lay))
                places, sigma = [], []
                for (d, t), _lay in zip(zip(used, tps, strict=False), layouts, strict=False):
                    per_server = model.profiles.devices[d].devices_per_server
                    for r in range(devices[d] // t):
                        places.append(Placement(d, t, f"{d}-{r * t // per_server}"))
                        sigma.append(model.stage_compute(d, b, t, 0, n_blocks, ckpt))
                counts = _deal(sigma, [p.tp for p in places], n_micro) if deal else _water_fill(sigma, n_micro)
                if counts is None:
                    continue
                reps = tuple(Replica((p,), m) for p, m in zip(places, counts, strict=False) if m > 0)
                plan = Plan(b, (0, n_blocks), reps, ckpt, sharding)  # type: ignore[arg-type]
                out.append((model.predict(plan).iteration_s, plan))
                break  # sharding only when plain replicas do not fit
    return out


def _deal(times: list[float], devices: list[int], n: int) -> list[int] | None:
    """Water-filling over the replicas that can run their share: a replica dealt fewer micro-batches than it has
    devices (but some) is left out, the slowest first, and the rest filled again; None if none is left."""
    active = list(range(len(times)))
    while active:
        share = _water_fill([times[r] for r in active], n)
        short = [r for r, m in zip(active, share, strict=True) if 0 < m < devices[r]]
        if not short:
            counts = [0] * len(times)
            for r, m in zip(active, share, strict=True):
                counts[r] = m
            return counts
        active.remove(max(short, key=lambda r: times[r]))
    return None


def _subsets(types: list[str]) -> list[tuple[str, ...]]:
    return [c for k in range(1, len(types) + 1) for c in itertools.combinations(types, k)]


def _pipeline_plans(
    model: CostModel,
    devices: dict[str, int],
    b: int,
    n_micro: int,
    stage_counts: tuple[int, ...],
    tp_candidates: int,
    smallest: Shortfall,
    even_split: bool,
    deal: bool = False,
) -> list[tuple[float, Callable[[], Plan | None]]]:
    out = []
    for n_stages in stage_counts:
        if n_stages < 2 or n_stages > model.profiles.num_blocks:
            continue
        for used in _subsets(list(devices)):
            for order in itertools.permutations(used):
                for split in _compositions(n_stages, len(order)):
                    per_type = [
                        _tps(model, d, b, devices[d] // k, tp_candidates) for d, k in zip(order, split, strict=False)
                    ]
                    for tps in itertools.product(*per_type):
                        replicas = min(devices[d] // (t * k) for d, t, k in zip(order, tps, split, strict=False))
                        if replicas < 1:
                            continue
                        stages = [(d, t) for d, t, k in zip(order, tps, split, strict=False) for _ in range(k)]
                        if deal and max(1, n_micro // replicas) < sum(t for _, t in stages):
                            continue  # a replica's devices would outnumber its micro-batches
                        for sharding in ("none", "full"):
                            found = _split_blocks(model, stages, b, replicas, n_micro, sharding, smallest, even_split)  # type: ignore[arg-type]
                            if found is not None:
                                out.append(found)
                                break
    return out


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=False))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def _place(model: CostModel, stages: list[tuple[str, int]], replicas: int) -> list[list[Placement]]:
    """``placements[s][r]``: the replicas of a stage packed onto the fewest servers of its type, stage after stage."""
    cursor: dict[str, int] = {}
    out = []
    for d, t in stages:
        per_server = model.profiles.devices[d].devices_per_server
        row = []
        for _ in range(replicas):
            at = cursor.get(d, 0)
            if at // per_server != (at + t - 1) // per_server:  # a TP group never spans two servers
                at = (at // per_server + 1) * per_server
            row.append(Placement(d, t, f"{d}-{at // per_server}"))
            cursor[d] = at + t
        out.append(row)
    return out


def _split_blocks(
    model: CostModel,
    stages: list[tuple[str, int]],
    b: int,
    replicas: int,
    n_micro: int,
    sharding: Sharding,
    smallest: Shortfall,
    even_split: bool = False,
) -> tuple[float, Callable[[], Plan | None]] | None:
    """The layerwise DP over block boundaries for one pipeline template: the estimated iteration time and how to
    build the plan (placements and checkpoint sets are only built for the few best); None if no split fits."""
    n_blocks = model.profiles.num_blocks
    n_stages = len(stages)
    micro = -(-n_micro // replicas)
    shards = replicas if sharding == "full" else 1
    heads = _first_replica(model, stages, replicas)
    idx_i, idx_j = _grid(n_blocks)
    sigmas = []
    for s, (d, t) in enumerate(stages):
        sigma = _stage_matrix(model, d, t, b, min(micro, n_stages - s), shards, (s, n_stages, micro))
        if s + 1 < n_stages:
            sigma = sigma + _send_times(model, b, heads[s], heads[s + 1])[idx_j]
        if s > 0:
            sigma = sigma + _send_times(model, b, heads[s], heads[s - 1])[idx_i]
        if even_split:  # only the even boundaries may end a stage
            allowed = np.full(n_blocks + 1, np.inf)
            allowed[_even_bounds(n_blocks, n_stages)[s + 1]] = 0.0
            sigma = sigma + allowed[None, :]
        sigmas.append(sigma)
    bottleneck, bounds = _bottleneck_split(sigmas)
    if not math.isfinite(bottleneck):
        _closest_split(model, stages, b, micro, shards, smallest)
        return None
    steps = [float(sigmas[s][bounds[s], bounds[s + 1]]) for s in range(n_stages)]
    sync = 0.0
    for s, (d, t) in enumerate(stages):
        per_server = model.profiles.devices[d].devices_per_server
        server = "one" if replicas * t <= per_server else ""
        group = [Placement(d, t, server)] * replicas
        sync = max(sync, model.allreduce_s(model.params(bounds[s], bounds[s + 1], t), group))
    update = max(model.stage_update(d, b, t, bounds[s], bounds[s + 1]) for s, (d, t) in enumerate(stages))
    estimate = sum(steps) + (micro - 1) * max(steps) + sync + update

    def build() -> Plan | None:
        ckpt: set[int] = set()
        for s, (d, t) in enumerate(stages):
            buffers = model.pipeline_buffers(b, bounds[s], bounds[s + 1], s, n_stages, micro)
            lay = _fitting_layout(model, d, b, t, bounds[s], bounds[s + 1], min(micro, n_stages - s), shards, buffers)
            if lay is None:
                return None
            ckpt |= lay[1]
        places = _place(model, stages, replicas)
        counts = [n_micro // replicas + (1 if r < n_micro % replicas else 0) for r in range(replicas)]
        reps = tuple(Replica(tuple(places[s][r] for s in range(n_stages)), m) for r, m in enumerate(counts) if m > 0)
        return Plan(b, tuple(bounds), reps, frozenset(ckpt), sharding)

    return estimate, build


def _closest_split(
    model: CostModel, stages: list[tuple[str, int]], b: int, micro: int, shards: int, smallest: Shortfall
) -> None:
    """Offer the split whose largest need over its device's memory is least, every block checkpointed
    (the same DP: ``g_s[j] = min_i max(g_{s-1}[i], need_s(i, j) / budget_s)``)."""
    n_stages = len(stages)
    needs = [
        _least_memory(model, d, t, b, min(micro, n_stages - s), shards, (s, n_stages, micro))
        for s, (d, t) in enumerate(stages)
    ]
    _, bounds = _bottleneck_split(
        [need / model.profiles.devices[d].memory_bytes for need, (d, _) in zip(needs, stages, strict=True)]
    )
    for s, (d, _) in enumerate(stages):
        smallest.offer(float(needs[s][bounds[s], bounds[s + 1]]), d, model.profiles.devices[d].memory_bytes)


def _bottleneck_split(cost: list[np.ndarray]) -> tuple[float, list[int]]:
    """Galvatron's layerwise DP over stage boundaries: ``f_s[j] = min_{i<j} max(f_{s-1}[i], cost_s[i, j])``; the
    least ``max_s cost_s`` over every split of the blocks into ``len(cost)`` stages, and that split's bounds."""
    n_blocks = cost[0].shape[0] - 1
    f = cost[0][0].copy()
    choice = [np.zeros(n_blocks + 1, dtype=int)]
    for c in cost[1:]:
        cand = np.maximum(f[:, None], c)
        choice.append(cand.argmin(axis=0))
        f = cand.min(axis=0)
    bounds = [n_blocks]
    for s in range(len(cost) - 1, 0, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    return float(f[n_blocks]), [0, *reversed(bounds)]


def _least_memory(
    model: CostModel, d: str, t: int, b: int, in_flight: int, shards: int, position: tuple[int, int, int]
) -> np.ndarray:
    """``need[i, j]``: peak memory of a stage holding blocks ``i..j-1``, every one checkpointed (``inf`` if empty);
    ``position``: the stage's index, the stage count and the micro-batches a replica runs."""
    key = ("least", d, t, b, in_flight, shards, position)
    if key not in model.memo:
        n_blocks = model.profiles.num_blocks
        need = np.full((n_blocks + 1, n_blocks + 1), np.inf)
        for i in range(n_blocks):
            for j in range(i + 1, n_blocks + 1):
                buffers = model.pipeline_buffers(b, i, j, *position)
                need[i, j] = model.stage_memory(d, b, t, i, j, frozenset(range(i, j)), in_flight, shards, buffers)
        model.memo[key] = need
    return model.memo[key]


def _first_replica(model: CostModel, stages: list[tuple[str, int]], replicas: int) -> list[Placement]:
    """Replica 0's placements as ``_place`` packs them (TP degrees divide the devices per server)."""
    cursor: dict[str, int] = {}
    out = []
    for d, t in stages:
        at = cursor.get(d, 0)
        out.append(Placement(d, t, f"{d}-{at // model.profiles.devices[d].devices_per_server}"))
        cursor[d] = at + replicas * t
    return out


def _send_times(model: CostModel, b: int, a: Placement, c: Placement) -> np.ndarray:
    """``out[j]``: time to send the output of block ``j - 1`` (``out[0]``: nothing) from ``a`` to ``c``."""
    key = ("send", b, a.device, a.tp, c.device, c.tp, a.server == c.server)
    if key not in model.memo:
        sizes = [0.0] + [b * blk.boundary_bytes for blk in model.blocks.blocks]
        model.memo[key] = np.array([model.send_s(x, a, c) for x in sizes])
    return model.memo[key]


def _grid(n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``i`` and ``j`` of every stage ``blocks i..j-1`` as two ``(n+1, n+1)`` arrays."""
    return np.meshgrid(np.arange(n_blocks + 1), np.arange(n_blocks + 1), indexing="ij")  # type: ignore[return-value]


def _stage_matrix(
    model: CostModel, d: str, t: int, b: int, in_flight: int, shards: int, position: tuple[int, int, int]
) -> np.ndarray:
    """``sigma[i, j]``: compute time per micro-batch of a stage holding blocks ``i..j-1`` on ``t`` devices ``d``,
    with the checkpointed blocks it needs to fit (``inf`` if it cannot); ``position`` as for :func:`_least_memory`.
    Cached on the model: the DP asks for the same matrices for every pipeline template."""
    cache = model.memo
    key = (d, t, b, in_flight, shards, position)
    if key in cache:
        return cache[key]
    blocks = model.blocks
    n_blocks = model.profiles.num_blocks
    idx_i, idx_j = _grid(n_blocks)
    valid = idx_j > idx_i
    count = np.where(valid, idx_j - idx_i, 1)
    rows = np.array(model.times(d, b, t))
    act = np.array([blocks.activations(i, t) for i in range(n_blocks)])
    par = np.array([blocks.params(i, t) for i in range(n_blocks)])
    out = np.array([blk.boundary_bytes for blk in blocks.blocks])
    extra = np.array(model.checkpoint_s(d, b, t))
    per_block = {"fb": rows[:, 0] + rows[:, 1], "f": extra, "a": act, "w": par, "sav": act - out}
    span = {}
    for k, v in per_block.items():
        pre = np.concatenate([[0.0], np.cumsum(v)])
        span[k] = pre[idx_j] - pre[idx_i]
    k_w = 2 + blocks.framework_bytes_per_param_byte + blocks.optimizer_bytes_per_param_byte / shards
    stage, stages, micro = position
    buffers = np.zeros_like(span["w"])
    if stages > 1 and blocks.microbatch_buffers:  # CostModel.pipeline_buffers over every (i, j)
        before = np.concatenate([[0.0], out])  # before[k]: the output of block k - 1
        if stage > 0:
            buffers = buffers + micro * b * before[idx_i]
        buffers = buffers + micro * b * (before[idx_j] if stage < stages - 1 else blocks.output_bytes)
    held = span["w"] * k_w + buffers + model.profiles.devices[d].reserve(t)
    budget = model.profiles.devices[d].memory_bytes
    excess = held + in_flight * b * span["a"] - budget
    save = in_flight * b * span["sav"] / count
    need = np.where(excess > 0, np.ceil((excess + b * span["a"] / count) / np.maximum(save, 1.0)), 0)
    sigma = span["fb"] + need * span["f"] / count
    step_fits = held + blocks.step_bytes_per_param_byte * span["w"] / shards <= budget
    sigma = np.where(valid & (need <= count) & step_fits, sigma, np.inf)
    cache[key] = sigma
    return sigma


def _even_bounds(n_blocks: int, n_stages: int) -> list[int]:
    """Blocks split as evenly as possible, the first stages taking one more when it does not divide."""
    size, extra = divmod(n_blocks, n_stages)
    return [s * size + min(s, extra) for s in range(n_stages + 1)]
