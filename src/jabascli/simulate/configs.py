"""Training configurations on an allocation of traced GPUs, and their iteration times.

An *allocation* is a number of GPUs per GPU type, each type's GPUs packed on as
few nodes as possible. Three ways to run a GBS on it:

- **uniform** (plain DDP, and one GPU type with gradient accumulation): every GPU
  runs the same LBS and the same number of micro-steps ``m``; the GBS is exactly
  ``lbs * gpus * m``. The slowest GPU paces the iteration.
- **IIDP** (jabas): every GPU runs the same LBS ``b``, and the GPUs of type ``t``
  run ``m_t`` micro-steps each (VSWs and GA steps, charged alike, see below), so
  ``GBS = b * sum_t gpus_t * m_t``. :func:`iidp_frontier` lists, for each ``b``,
  the fastest way to reach every GBS: with a time budget ``T`` per iteration the
  most micro-steps type ``t`` fits is ``floor(T / c_t)`` (``c_t`` its compute time
  per micro-step), so sweeping ``T`` over the breakpoints ``m * c_t`` enumerates
  the exact (GBS, time) frontier, where faster types run more micro-steps and no
  GPU waits longer than one micro-step.

Timing model (docs/simulation.md):

- compute per micro-step ``c_t(b) = step_t(b) - sync_t(b)`` at the type's own
  placement (Pollux's accumulation rule); a VSW is charged the same as a GA step:
  the trace does not measure concurrent streams, so no overlap gain is assumed;
- iteration = ``max_t m_t * c_t(b) + sync(b)``; the synchronisation of a job on
  one type (or with only one type running micro-steps) is that type's traced
  ``sync_time``. A job whose micro-steps run on several types all-reduces across
  nodes, so each active type pays at least what its GPUs split over two nodes
  take (``Timing.compute_and_sync``), and the slowest type's synchronisation
  paces the ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jabascli.simulate.steptime import Placement, StepTimes, packed_placement

LBS_STEPS_PER_OCTAVE = 4

Allocation = tuple[tuple[str, int], ...]  # (GPU type, GPUs), types in cluster order, GPUs > 0


def allocation_of(gpus: dict[str, int]) -> Allocation:
    return tuple((t, g) for t, g in gpus.items() if g > 0)


def describe(allocation: Allocation, per_node: dict[str, int]) -> str:
    """``aws:2n,rtx:4g``: whole nodes as ``n``, a part of a node as GPUs."""
    parts = []
    for t, g in allocation:
        nodes, rest = divmod(g, per_node[t])
        parts.append(f"{t}:{nodes}n" if not rest else f"{t}:{g}g")
    return ",".join(parts)


@dataclass(frozen=True)
class Config:
    """How one iteration runs: LBS, micro-steps per GPU of each type, GBS and time."""

    gbs: float
    lbs: float
    iter_s: float
    micro_steps: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Frontier:
    """Every (GBS, iteration time) an allocation reaches with IIDP (see module docstring)."""

    types: tuple[str, ...]
    gbs: np.ndarray
    iter_s: np.ndarray
    lbs: np.ndarray
    steps: np.ndarray  # [point, type] micro-steps per GPU

    def config(self, i: int) -> Config:
        return Config(
            gbs=float(self.gbs[i]),
            lbs=float(self.lbs[i]),
            iter_s=float(self.iter_s[i]),
            micro_steps={t: int(m) for t, m in zip(self.types, self.steps[i], strict=True)},
        )

    def best_goodput(self, efficiency: np.ndarray) -> int:
        """Index of the point of highest goodput ``E(gbs) * gbs / iter_s`` (``efficiency`` per point)."""
        return int(np.argmax(efficiency * self.gbs / self.iter_s))


class Timing:
    """Iteration-time model of a cluster's GPU types (the formulas above)."""

    def __init__(self, step_times: dict[str, StepTimes], batch_sizes: tuple[float, ...] = ()) -> None:
        self.step_times = step_times
        self.batch_sizes = batch_sizes
        self.per_node = {t: s.gpus_per_node for t, s in step_times.items()}
        self._frontiers: dict[tuple[Allocation, float, float], Frontier | None] = {}

    def placement(self, gpu_type: str, gpus: int) -> Placement:
        return packed_placement(gpus, self.per_node[gpu_type])

    def _sync_placement(self, gpu_type: str, gpus: int, multi_node: bool) -> Placement:
        own = self.placement(gpu_type, gpus)
        if not multi_node or len(own) >= 2:
            return own
        return (math.ceil(gpus / 2), gpus // 2) if gpus >= 2 else (1, 1)

    def compute_and_sync(
        self, allocation: Allocation, lbs: float
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float]] | None:
        """Per type: compute per micro-step ``c_t(lbs)``, the sync it pays alone, and with other types.

        *Alone* (the only type running micro-steps): the traced ``sync_time`` of its
        own placement. *With other types* the all-reduce crosses nodes, so a type on
        one node pays at least what its GPUs split over two nodes take: one
        micro-step there lasts the traced ``step_time`` of that split placement, so
        its sync is ``max(sync_split, step_split - c_t)``. (The trace's split of a
        step into compute and sync differs between placements: azure's 8 GPUs on one
        node sync in 0.066 s at LBS 64, on two nodes in 0.030 s with twice the
        compute, so taking the compute of one and the sync of the other would run
        8 V100s a third faster than any traced step.)

        A type whose traced range does not cover ``lbs`` is left out; ``None`` when
        no type covers it.
        """
        nodes = sum(len(self.placement(t, g)) for t, g in allocation)
        multi = nodes > 1 and len(allocation) > 1
        compute: dict[str, float] = {}
        alone: dict[str, float] = {}
        mixed: dict[str, float] = {}
        for t, g in allocation:
            own = self.step_times[t].at(self.placement(t, g), lbs)
            if own is None:
                continue
            split = self.step_times[t].at(self._sync_placement(t, g, multi), lbs) if multi else own
            if split is None:
                continue
            compute[t] = own[0] - own[1]
            alone[t] = own[1]
            mixed[t] = max(split[1], split[0] - compute[t]) if multi else own[1]
        return (compute, alone, mixed) if compute else None

    def uniform(self, allocation: Allocation, gbs: float) -> Config | None:
        """Every GPU at the same LBS and micro-steps, GBS exactly ``gbs``; ``None`` if it does not fit."""
        gpus = sum(g for _, g in allocation)
        per_gpu = gbs / gpus
        lo = max(self.step_times[t].lbs_range(self.placement(t, g))[0] for t, g in allocation)
        hi = min(self.step_times[t].lbs_range(self.placement(t, g))[1] for t, g in allocation)
        if per_gpu < lo - 1e-9 or hi < lo:
            return None
        steps = max(1, math.ceil(per_gpu / hi - 1e-9))
        lbs = per_gpu / steps
        if lbs < lo - 1e-9:
            return None
        parts = self.compute_and_sync(allocation, lbs)
        if parts is None or len(parts[0]) < len(allocation):
            return None
        compute, alone, mixed = parts
        iter_s = steps * max(compute.values()) + max((mixed if len(allocation) > 1 else alone).values())
        return Config(gbs=gbs, lbs=lbs, iter_s=iter_s, micro_steps={t: steps for t, _ in allocation})

    def lbs_candidates(self, allocation: Allocation) -> np.ndarray:
        """The LBS tried on ``allocation``.

        Every traced LBS, whole numbers a quarter-octave apart between them, and
        each whole LBS that puts a traced batch size exactly on the allocation's
        GPUs (or on one type's), so IIDP can run whatever a fixed-batch run can.
        """
        traced = np.concatenate([self.step_times[t].traced_lbs for t, _ in allocation])
        lo, hi = float(traced.min()), float(traced.max())
        grid = np.round(
            lo * 2.0 ** (np.arange(0, math.log2(hi / lo) * LBS_STEPS_PER_OCTAVE + 1) / LBS_STEPS_PER_OCTAVE)
        )
        counts = {sum(g for _, g in allocation)} | {g for _, g in allocation}
        exact = [b / n for b in self.batch_sizes for n in counts if b % n == 0 and lo <= b / n <= hi]
        return np.unique(np.concatenate([traced, grid[grid <= hi], np.array(exact, dtype=float)]))

    def frontier(self, allocation: Allocation, min_gbs: float, max_gbs: float) -> Frontier | None:
        """IIDP's (GBS, iteration time) frontier of ``allocation`` within ``[min_gbs, max_gbs]``."""
        key = (allocation, min_gbs, max_gbs)
        if key not in self._frontiers:
            self._frontiers[key] = self._frontier(allocation, min_gbs, max_gbs)
        return self._frontiers[key]

    def _frontier(self, allocation: Allocation, min_gbs: float, max_gbs: float) -> Frontier | None:
        types = tuple(t for t, _ in allocation)
        gpus = np.array([g for _, g in allocation], dtype=float)
        candidates = self.lbs_candidates(allocation)
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for b in candidates:
            parts = self.compute_and_sync(allocation, float(b))
            if parts is None:
                continue
            compute, alone, mixed = parts
            c = np.array([compute.get(t, np.inf) for t in types])
            s_alone = np.array([alone.get(t, 0.0) for t in types])
            s_mixed = np.array([mixed.get(t, 0.0) for t in types])
            usable = np.isfinite(c)
            limit = np.floor(max_gbs / (b * gpus[usable])).astype(int)
            budgets = np.unique(np.concatenate([c[usable][i] * np.arange(1, n + 1) for i, n in enumerate(limit)]))
            if budgets.size == 0:
                continue
            with np.errstate(invalid="ignore"):
                steps = np.floor(budgets[:, None] / c[None, :] + 1e-9)
            steps[:, ~usable] = 0
            gbs = b * steps @ gpus
            active = steps > 0
            # one type running micro-steps syncs as it does alone; several cross nodes
            sync = np.where(active.sum(axis=1, keepdims=True) > 1, s_mixed[None, :], s_alone[None, :])
            active_sync = np.where(active, sync, 0.0).max(axis=1)
            keep = (gbs >= min_gbs - 1e-9) & (gbs <= max_gbs + 1e-9)
            if keep.any():
                rows.append((gbs[keep], budgets[keep] + active_sync[keep], np.full(keep.sum(), float(b)), steps[keep]))
        if not rows:
            return None
        return Frontier(
            types=types,
            gbs=np.concatenate([r[0] for r in rows]),
            iter_s=np.concatenate([r[1] for r in rows]),
            lbs=np.concatenate([r[2] for r in rows]),
            steps=np.concatenate([r[3] for r in rows]).astype(int),
        )
