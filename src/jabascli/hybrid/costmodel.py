"""Cost model of one iteration of a hybrid plan on servers of different device types, and peak memory per device.

Notation (docs/hybrid-planner.md): replica ``r`` runs ``M_r`` micro-batches of ``b`` samples through ``S`` stages;
stage ``s`` of replica ``r`` runs on ``t`` devices of type ``d``. From the profiles, per block ``i``: ``f_i, g_i, u_i``
(forward, backward, update seconds at ``(b, t)`` on ``d``), ``P_i(t)`` parameter bytes per device, ``A_i(t)``
activation bytes per sample, ``O_i`` output bytes per sample.

* stage compute per micro-batch: ``c_s = sum_i f_i + g_i + [i checkpointed] k_i`` (TP collectives are inside the
  measured times at degree ``t``); ``k_i``, what checkpointing the block adds, is the measured checkpointed forward
  and backward over ``f_i + g_i`` where the profile has them (``jabas profile hybrid``, TP 1), else ``f_i`` (one more
  forward);
* pipeline transfers per micro-batch: ``x_s = send(b O_last(s)) + send(b O_last(s-1))`` (activations forward,
  their gradients back), ``send(S)`` the measured point-to-point time of ``S`` bytes on that link where the profile
  has it (``jabas profile hybrid``), else ``S / bw(S)`` on the link between the two placements;
* pipeline (1F1B and GPipe alike): ``T_r = sum_s (c_s + x_s) + (M_r - 1) max_s (c_s + x_s)``;
* update: ``U = max_{r,s} sum_{i in s} u_i``;
* gradient synchronisation of stage ``s`` over its ``R`` replicas, each of the ``t`` devices all-reducing its
  ``P_s(t)`` bytes in a ring: ``G_s = 2 (R-1)/R * t P_s(t) / bw_inter(t P_s(t) / R)`` (the ``t`` devices of a server
  share its links: the fit for ``t`` devices is their aggregate); with ``sharding = full`` the same bytes move as a
  reduce-scatter plus an all-gather;
* iteration: ``T = max_r T_r + max_s G_s + U``: the synchronisation starts when the slowest replica has finished its
  last backward (IIDP gives faster replicas more micro-batches so that they finish together).

Sharded (``sharding = full``) where every device type of the plan has measured sharded rows at ``b`` (the profile's
``sharded``; TP 1): per block ``f'_i`` (forward, FSDP2 hooks), ``f1_i`` (the first forward, its unit's all-gather
included), ``g'_i`` (backward), ``gL_i`` (the last backward, its reduce-scatter included), ``u'_i`` (the update on the
shards), each measured over 2 ranks, emulation included (docs/formats.md). Then

* ``c_s = sum_i f'_i + g'_i + [i checkpointed] f'_i``, and once per iteration ``E_s = gat_s + rs_s`` with
  ``gat_s = sum_i max(0, f1_i - f'_i)``, ``rs_s = sum_i max(0, gL_i - g'_i)`` (the runtime keeps the parameters
  gathered from the first forward to the last backward when the replicas' micro-batch counts differ); when every
  replica runs the same count ``M`` the runtime runs ZeRO-3 proper, a gather each forward and again each backward:
  ``E_s = 2 M gat_s + rs_s``;
* ``T_r = sum_s (c_s + x_s) + (M_r - 1) max_s (c_s + x_s) + sum_s E_s``; ``G_s = 0`` (the collectives are inside
  ``E_s``); ``U = max_{r,s} sum_{i in s} u'_i``.
* one stage, replicas of unequal counts: the gathers and reduce-scatters pair up unit by unit across the replicas,
  so a faster replica's first forward and last backward go at the slowest replica's pace, unit by unit. With
  ``gl_{r,i} = gL_i + [i checkpointed] f'_i`` on replica ``r``'s device and ``c_r`` its ``c_s``: the first forward
  ends at ``E = sum_i max_r f1_i``, replica ``r`` starts its last backward at ``L_r = E + (M_r - 1) c_r``, and every
  replica ends at ``T = max_r (L_r + gl_{r,n-1}) + sum_{i < n-1} max_r gl_{r,i}`` (units in backward order).

The rows are measured over 2 ranks of one machine and used as they are for ``R`` replicas (an estimate for
``R > 2``). Where a stage's replicas span servers, ``E_s`` also takes what its collectives cost on the ``inter`` link
beyond the ``intra`` one: per block of ``P_i`` parameter bytes, ``n_g (AG_inter(P_i) - AG_intra(P_i)) +
RS_inter(P_i) - RS_intra(P_i)`` from the measured collectives (``n_g`` = ``2 M`` under ZeRO-3 proper, else 1; at
least 0 over the stage). Profiles without the rows (imported Sailor and Galvatron ones) price ``full`` as above with
the unsharded times.

Links: ``intra`` is what devices of one server exchange over, ``inter`` what crosses between servers; both come from
the network profile (``jabas profile hybrid`` measures ``intra`` on this machine, and ``inter`` between two nodes
where :func:`jabascli.profiler.hybrid.measure_link` ran on both). Every cross-server term above (sends between stages
on different servers, gradient sync over replicas on several servers, sharded collectives across servers) is priced
on the ``inter`` link, so a slower link makes exactly those plans dearer.

Peak memory of a device of stage ``s`` in replica ``r``, with ``W = P_s(t)`` and ``R' = R`` if sharded else 1:
``mem = W (2 + k_f) + k_o W / R' + B_s + reserve(t) + max(n_s a_s + r_s, k_s W / R')`` where ``k_o``/``k_f`` are
the profile's optimizer and framework bytes per parameter byte, ``a_s = b sum_i (A_i(t), or O_i if checkpointed)``,
``r_s = b max_{i checkpointed} A_i(t)`` (one block recomputed at a time, however many micro-batches are in flight),
``n_s`` the micro-batches in flight: ``min(M_r, S - s)`` under 1F1B, ``M_r`` under GPipe; the last term is the
larger of the backward's activations and what the optimizer step allocates and frees again (``k_s`` per parameter
byte it updates). ``B_s``: jabas's pipeline runtime keeps every micro-batch's buffers for the whole iteration,
``B_s = M_r b ([s > 0] O_first(s)-1 + [s < S-1] O_last(s) + [s = S-1] O_model)`` (received activations, received
gradients, the model's outputs for the loss); 0 where the profiles come from another planner's runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jabascli.errors import InputError
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.profiles.hybrid import HybridProfiles


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    pipeline_s: tuple[float, ...]
    """``T_r`` per replica."""
    sync_s: float
    update_s: float
    peak_bytes: tuple[tuple[float, ...], ...]
    """``peak_bytes[r][s]``: peak memory of a device of stage ``s`` of replica ``r``."""
    fits: bool

    @property
    def max_peak_bytes(self) -> float:
        return max(max(row) for row in self.peak_bytes)


class CostModel:
    def __init__(self, profiles: HybridProfiles) -> None:
        self.profiles = profiles
        self.blocks = profiles.blocks
        self._send_cache: dict[tuple[object, ...], float] = {}
        self._param_prefix: dict[int, list[float]] = {}
        self.memo: dict[tuple[object, ...], Any] = {}
        """What the search derives from these profiles and keeps for its next candidates."""
        self._stage_cache: dict[tuple[str, int, int, int, int, frozenset[int]], tuple[float, float]] = {}

    # --- pieces -------------------------------------------------------------------------------------------------
    def stage_compute(self, device: str, mbs: int, tp: int, first: int, last: int, ckpt: frozenset[int]) -> float:
        """``c_s``: forward + backward (+ recompute) of blocks ``first..last-1`` for one micro-batch."""
        return self._stage(device, mbs, tp, first, last, ckpt)[0]

    def stage_update(self, device: str, mbs: int, tp: int, first: int, last: int) -> float:
        return self._stage(device, mbs, tp, first, last, frozenset())[1]

    def _stage(
        self, device: str, mbs: int, tp: int, first: int, last: int, ckpt: frozenset[int]
    ) -> tuple[float, float]:
        key = (device, mbs, tp, first, last, ckpt)
        hit = self._stage_cache.get(key)
        if hit is not None:
            return hit
        rows = self.times(device, mbs, tp)
        extra = self.checkpoint_s(device, mbs, tp)
        compute = sum(rows[i][0] + rows[i][1] + (extra[i] if i in ckpt else 0.0) for i in range(first, last))
        update = sum(rows[i][2] for i in range(first, last))
        self._stage_cache[key] = (compute, update)
        return compute, update

    def times(self, device: str, mbs: int, tp: int) -> list[tuple[float, float, float]]:
        dev = self.profiles.devices.get(device)
        if dev is None:
            raise InputError.at(None, f"device {device}", f"no hybrid profile (have {sorted(self.profiles.devices)})")
        rows = dev.block_times(mbs, tp)
        if rows is None or len(rows) < self.profiles.num_blocks:
            raise InputError.at(
                None, f"device {device}", f"no block times at micro-batch size {mbs} and TP degree {tp}"
            )
        return rows

    def checkpoint_s(self, device: str, mbs: int, tp: int) -> list[float]:
        """``k_i``: what checkpointing block ``i`` adds to a micro-batch: the measured checkpointed forward and
        backward over the plain ones where the profile has them (TP 1), else one more forward ``f_i``."""
        key = ("checkpoint", device, mbs, tp)
        hit = self.memo.get(key)
        if hit is None:
            rows = self.times(device, mbs, tp)
            measured = self.profiles.devices[device].checkpointed.get(mbs) if tp == 1 else None
            if measured is not None and len(measured) >= len(rows):
                hit = [max(fc + gc - f - g, 0.0) for (fc, gc), (f, g, _) in zip(measured, rows, strict=False)]
            else:
                hit = [f for f, _, _ in rows]
            self.memo[key] = hit
        return hit

    def send_s(self, size: float, a: Placement, b: Placement) -> float:
        """Point-to-point time of ``size`` bytes from one placement to another."""
        if size <= 0:
            return 0.0
        intra = bool(a.server) and a.server == b.server
        key = (size, a.device, a.tp, b.device, b.tp, intra)
        hit = self._send_cache.get(key)
        if hit is None:
            net = self.profiles.network
            hit = net.measured_seconds("send", "intra" if intra else "inter", size)
            if hit is None and intra:
                hit = net.fit("intra", a.device, 2).seconds(size)
            elif hit is None:
                hit = max(net.fit("inter", p.device, p.tp).seconds(size) for p in (a, b))
            self._send_cache[key] = hit
        return hit

    def allreduce_s(self, size: float, group: list[Placement]) -> float:
        """Ring all-reduce of ``size`` bytes per device over ``group`` (one device of each placement per ring, the
        placement's ``tp`` devices running their rings at once over the server's links)."""
        n = len(group)
        if n <= 1 or size <= 0:
            return 0.0
        net = self.profiles.network
        servers = {p.server for p in group}
        if len(servers) == 1 and "" not in servers:
            fit = net.fit("intra", group[0].device, n)
            return 2 * (n - 1) / n * size / fit.bandwidth(size / n)
        slowest = 0.0
        for p in {(q.device, q.tp): q for q in group}.values():
            fit = net.fit("inter", p.device, p.tp)
            slowest = max(slowest, 2 * (n - 1) / n * p.tp * size / fit.bandwidth(p.tp * size / n))
        return slowest

    def params(self, first: int, last: int, tp: int) -> float:
        prefix = self._param_prefix.get(tp)
        if prefix is None:
            prefix = [0.0]
            for i in range(self.profiles.num_blocks):
                prefix.append(prefix[-1] + self.blocks.params(i, tp))
            self._param_prefix[tp] = prefix
        return prefix[last] - prefix[first]

    def activations(self, mbs: int, tp: int, first: int, last: int, ckpt: frozenset[int]) -> tuple[float, float]:
        """``(a_s, r_s)``: activation bytes one micro-batch leaves on a device of the stage until its backward, and
        what recomputing its largest checkpointed block takes back (one block at a time, whatever is in flight)."""
        kept = 0.0
        recompute = 0.0
        for i in range(first, last):
            if i in ckpt:
                kept += self.blocks.blocks[i].boundary_bytes
                recompute = max(recompute, self.blocks.activations(i, tp))
            else:
                kept += self.blocks.activations(i, tp)
        return mbs * kept, mbs * recompute

    def stage_memory(
        self,
        device: str,
        mbs: int,
        tp: int,
        first: int,
        last: int,
        ckpt: frozenset[int],
        in_flight: int,
        shards: int,
        buffers: float = 0.0,
    ) -> float:
        """Peak bytes of a device of the stage: the larger of its backward's peak and its optimizer step's."""
        w = self.params(first, last, tp)
        k_o = self.blocks.optimizer_bytes_per_param_byte
        k_f = self.blocks.framework_bytes_per_param_byte
        reserve = self.profiles.devices[device].reserve(tp) if device in self.profiles.devices else 0.0
        held = w * (2 + k_f) + k_o * w / shards + reserve + buffers
        kept, recompute = self.activations(mbs, tp, first, last, ckpt)
        backward = in_flight * kept + recompute
        return held + max(backward, self.blocks.step_bytes_per_param_byte * w / shards)

    def pipeline_buffers(self, mbs: int, first: int, last: int, stage: int, stages: int, microbatches: int) -> float:
        """``B_s``: what the pipeline runtime keeps of every micro-batch of the iteration on stage ``s`` (module
        docstring); 0 outside a pipeline or where the profiles' runtime reuses its buffers."""
        if stages == 1 or not self.blocks.microbatch_buffers:
            return 0.0
        kept = self.blocks.blocks[first - 1].boundary_bytes if stage > 0 else 0.0
        kept += self.blocks.blocks[last - 1].boundary_bytes if stage < stages - 1 else self.blocks.output_bytes
        return microbatches * mbs * kept

    def measured_sharded(self, plan: Plan) -> bool:
        """Whether ``plan`` is sharded and every placement has measured sharded rows at its micro-batch size."""
        if plan.sharding != "full":
            return False
        for rep in plan.replicas:
            for p in rep.stages:
                dev = self.profiles.devices.get(p.device)
                rows = dev.sharded.get(plan.mbs) if dev is not None else None
                if p.tp != 1 or rows is None or len(rows) < self.profiles.num_blocks:
                    return False
        return True

    def sharded_stage(
        self, device: str, mbs: int, first: int, last: int, ckpt: frozenset[int]
    ) -> tuple[float, float, float, float]:
        """Under measured sharding: ``c_s`` per micro-batch, ``gat_s``, ``rs_s`` and the update ``sum u'_i``."""
        rows = self.profiles.devices[device].sharded[mbs][first:last]
        compute = sum(r.fwd + r.bwd + (r.fwd if i in ckpt else 0.0) for i, r in enumerate(rows, start=first))
        gather = sum(max(0.0, r.fwd_first - r.fwd) for r in rows)
        scatter = sum(max(0.0, r.bwd_last - r.bwd) for r in rows)
        return compute, gather, scatter, sum(r.update for r in rows)

    def link_extra(self, plan: Plan, stage: int, gathers: int) -> float:
        """What stage ``stage``'s FSDP2 collectives take beyond the measured sharded rows' when its replicas span
        servers: per block ``gathers`` all-gathers and one reduce-scatter of its parameter bytes, each the ``inter``
        link's measured time less the ``intra`` one's (the rows were measured over two processes of one machine),
        0 when the replicas share a server or the profile lacks either link's rows."""
        servers = {rep.stages[stage].server for rep in plan.replicas if rep.microbatches > 0}
        if len(servers) == 1 and "" not in servers:
            return 0.0
        key = ("link_extra", plan.bounds[stage], plan.bounds[stage + 1], gathers)
        hit = self.memo.get(key)
        if hit is None:
            net = self.profiles.network
            hit = 0.0
            for i in plan.stage_blocks(stage):
                size = self.blocks.params(i, 1)
                for name, times in (("all_gather", gathers), ("reduce_scatter", 1)):
                    inter = net.measured_seconds(name, "inter", size)
                    intra = net.measured_seconds(name, "intra", size)
                    if inter is not None and intra is not None:
                        hit += times * (inter - intra)
            hit = max(hit, 0.0)
            self.memo[key] = hit
        return hit

    # --- the whole plan -----------------------------------------------------------------------------------------
    def predict(self, plan: Plan) -> Prediction:
        n_stages = plan.num_stages
        ckpt = frozenset(plan.checkpoint)
        measured = self.measured_sharded(plan)
        # ZeRO-3 proper (a gather each forward and each backward) when every replica runs as many micro-batches
        regather = measured and len({rep.microbatches for rep in plan.replicas}) == 1
        pipeline: list[float] = []
        update = 0.0
        peaks: list[tuple[float, ...]] = []
        fits = True
        shards = len(plan.replicas) if plan.sharding == "full" else 1
        cache: dict[tuple[object, ...], tuple[float, float, tuple[float, ...], bool]] = {}
        for rep in plan.replicas:
            if len(rep.stages) != n_stages:
                raise InputError.at(None, "plan", f"a replica has {len(rep.stages)} stages, the plan {n_stages}")
            # Replicas on the same device types, linked alike, with as many micro-batches cost the same.
            links = tuple(
                bool(a.server) and a.server == b.server for a, b in zip(rep.stages, rep.stages[1:], strict=False)
            )
            key = (tuple((p.device, p.tp) for p in rep.stages), links, rep.microbatches)
            if key not in cache:
                cache[key] = self._replica(plan, rep, ckpt, shards, measured, regather)
            t_r, u_r, row, ok = cache[key]
            pipeline.append(t_r)
            update = max(update, u_r)
            peaks.append(row)
            fits &= ok
        if measured and not regather and n_stages == 1 and len(plan.replicas) > 1:
            pipeline = [self._paired_units(plan, ckpt) + self.link_extra(plan, 0, 1)] * len(plan.replicas)
        sync = 0.0
        for s in range(n_stages if not measured else 0):  # measured sharding: the collectives are in T_r
            group = [rep.stages[s] for rep in plan.replicas if rep.microbatches > 0]
            size = self.params(plan.bounds[s], plan.bounds[s + 1], min(p.tp for p in group))
            sync = max(sync, self.allreduce_s(size, group))
        total = max(pipeline) + sync + update
        return Prediction(total, tuple(pipeline), sync, update, tuple(peaks), fits)

    def _paired_units(self, plan: Plan, ckpt: frozenset[int]) -> float:
        """``T`` of a one-stage sharded plan whose replicas' collectives pair up unit by unit (module docstring)."""
        reps = [rep for rep in plan.replicas if rep.microbatches > 0]
        rows = [self.profiles.devices[rep.stages[0].device].sharded[plan.mbs] for rep in reps]
        n = self.profiles.num_blocks
        first_forward = sum(max(r[i].fwd_first for r in rows) for i in range(n))

        def last_backward(r: list[Any], i: int) -> float:
            return r[i].bwd_last + (r[i].fwd if i in ckpt else 0.0)

        starts = [  # c_r: sharded_stage's compute of the whole model on the replica's device
            first_forward + (rep.microbatches - 1) * self.sharded_stage(rep.stages[0].device, plan.mbs, 0, n, ckpt)[0]
            for rep in reps
        ]
        top = max(start + last_backward(r, n - 1) for start, r in zip(starts, rows, strict=True))
        return top + sum(max(last_backward(r, i) for r in rows) for i in range(n - 1))

    def _replica(
        self,
        plan: Plan,
        rep: Replica,
        ckpt: frozenset[int],
        shards: int,
        measured: bool = False,
        regather: bool = False,
    ) -> tuple[float, float, tuple[float, ...], bool]:
        """``T_r``, the replica's update time, its devices' peak memory per stage, and whether all fit."""
        b, n_stages = plan.mbs, plan.num_stages
        steps = []
        row = []
        update = 0.0
        once = 0.0
        fits = True
        for s, place in enumerate(rep.stages):
            first, last = plan.bounds[s], plan.bounds[s + 1]
            sck = frozenset(i for i in ckpt if first <= i < last)
            if measured:
                compute, gather, scatter, u_s = self.sharded_stage(place.device, b, first, last, sck)
                gathers = 2 * rep.microbatches if regather else 1
                once += gathers * gather + scatter + self.link_extra(plan, s, gathers)
                update = max(update, u_s)
            else:
                compute = self.stage_compute(place.device, b, place.tp, first, last, sck)
                update = max(update, self.stage_update(place.device, b, place.tp, first, last))
            comm = 0.0
            if s + 1 < n_stages:
                comm += self.send_s(b * self.blocks.blocks[last - 1].boundary_bytes, place, rep.stages[s + 1])
            if s > 0:
                comm += self.send_s(b * self.blocks.blocks[first - 1].boundary_bytes, place, rep.stages[s - 1])
            steps.append(compute + comm)
            in_flight = rep.microbatches if plan.schedule == "gpipe" else min(rep.microbatches, n_stages - s)
            buffers = self.pipeline_buffers(b, first, last, s, n_stages, rep.microbatches)
            mem = self.stage_memory(place.device, b, place.tp, first, last, sck, in_flight, shards, buffers)
            row.append(mem)
            fits &= mem <= self.profiles.devices[place.device].memory_bytes
        t_r = sum(steps) + (rep.microbatches - 1) * max(steps) + once if rep.microbatches else 0.0
        return t_r, update, tuple(row), fits
