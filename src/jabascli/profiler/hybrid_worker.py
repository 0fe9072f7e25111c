"""One process of the hybrid profile: ``python -m jabascli.profiler.hybrid_worker SPEC RESULT``.

Two kinds of spec (``kind``):

* ``blocks``: the workload's model on this device, for every micro-batch size ``b`` of the spec, timed block by
  block inside whole training iterations (hooks stamp the clock as each block's forward starts and ends, and as
  its backward starts and ends): per block forward and backward seconds, and the part of the iteration before the
  first block (the embeddings) and after the last one (the head and the loss), forward and backward; the
  optimizer step; per block the parameter bytes (modules outside the blocks counted with the first block when
  they run before it, else with the last), the activation bytes kept for backward per sample (every tensor autograd
  saves while the block runs, parameters excepted, each storage once; what the embeddings save counted with the
  first block, the head's and the loss's with the last) and the block's output bytes per sample
  (what a checkpointed block keeps);
  the optimizer state bytes per parameter byte after one step and what the step allocates and frees again; the
  model's output bytes per sample; then every block's forward and backward again with
  every block checkpointed as the runtime checkpoints it (``fwd_ckpt``, ``bwd_ckpt``: the backward includes the
  recompute). With ``slowdown`` > 1 every block runs the engine's emulation of a device that much slower.
  With ``tp`` > 1 (``rank``, ``world_size`` = ``tp``, ``master_addr``, ``master_port``): one rank of a gloo TP
  group on loopback, every block split by the workload's TP plan (:func:`~jabascli.engine.parallel.tensor.
  parallelize_blocks`), the same iteration timed the same way (a fixed number of repetitions, so the ranks' collectives
  pair up), communication inside the blocks included; also each block's CPU time on this thread (what the engine's
  emulation of a slower device sleeps by). No sizes.
  With ``shard`` = 2 (``rank``, ``world_size`` = 2, ...): one rank of a group over which every block and then the
  model are FSDP2 units (:func:`~jabascli.engine.parallel.sharding.shard_model`, as the runtime's ``sharding =
  "full"`` with unequal micro-batch counts runs them: parameters gathered in the first forward, kept until the last
  backward reduce-scatters). Each timed iteration runs two micro-batches, the first without gradient sync (its
  forward pays each unit's all-gather), the second with it (its backward pays the reduce-scatters), then the update
  on the shards: per block ``fwd_first``, ``fwd``, ``bwd``, ``bwd_last`` and their CPU times, and ``update``. No sizes.
* ``collectives``: one rank of a gloo group on loopback, or across the link between two nodes: all-reduce,
  all-gather, reduce-scatter and a point-to-point send of every size, each the median of timed repetitions started
  together (the slowest rank's); and every rank's address towards the master (``hosts``).
"""

from __future__ import annotations

import sys
import time
from statistics import median
from typing import Any

from jabascli.profiler.child import emit_progress
from jabascli.profiler.worker import gather_hosts, group, join_group, time_collective, worker_main

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
IDLE_S = 0.002
"""Idle time before each timed forward and backward on a CPU (see ``micro``)."""


def measure_blocks(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from jabascli.engine.data import to_device
    from jabascli.workload import load_workload

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    workload = load_workload(spec["workload"], spec.get("options") or {}, spec.get("data"))
    tp = int(spec.get("tp", 1))
    shard = int(spec.get("shard", 1))
    device = torch.device(spec["device"])
    if (tp > 1 or shard > 1) and device.type == "cuda":
        device = torch.device("cuda", int(spec["rank"]))
    model = workload.build_model().to(device)
    blocks = workload.blocks(model)
    if not blocks:
        return {"status": "error", "error": f"workload {workload.name!r} declares no blocks (docs/workloads.md)"}
    n = len(blocks)
    if tp > 1:
        from jabascli.engine.parallel.tensor import tp_problem

        problem = tp_problem(blocks, workload, tp)
        if problem is not None:  # every rank finds the same, before any of them joins the group
            return {"status": "skip", "error": problem}
        _join_tp_group(spec, device, blocks, workload)
    units: list[Any] = []
    if shard > 1:
        units = _join_shard_group(spec, device, model, blocks)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    slowdown = float(spec.get("slowdown", 1.0))
    if slowdown != 1.0:  # first: each block's forward and backward end after its emulated sleep
        from jabascli.engine.parallel.runner import emulate_blocks
        from jabascli.engine.vsw import Emulation

        emulate_blocks(blocks, Emulation(slowdown))
    stamps: dict[tuple[str, int], float] = {}
    cpu: dict[tuple[str, int], float] = {}

    def stamp(key: tuple[str, int]) -> None:
        stamps[key] = clock()
        cpu[key] = time.thread_time()

    for i, block in enumerate(blocks):
        # prepend: before FSDP2's own pre-forward hook, so that a block's forward includes its unit's all-gather
        block.register_forward_pre_hook(lambda m, a, i=i: stamp(("f0", i)), prepend=True)
        block.register_forward_hook(lambda m, a, o, i=i: stamp(("f1", i)))
        block.register_full_backward_pre_hook(lambda m, g, i=i: stamp(("b0", i)))
        block.register_full_backward_hook(lambda m, gi, go, i=i: stamp(("b1", i)))
    optimizer = workload.optimizer(model.parameters())

    # On a CPU, a core that has just waited runs the next forward or backward slower (its caches went cold:
    # tiny GPT's blocks +30-45% after 2 ms idle, measured here). In a hybrid layout every op follows a wait (a
    # pipeline stage's for its neighbour, a sharded rank's at its collectives), so every op is timed after one.
    idle = float(spec.get("idle_s", IDLE_S if device.type == "cpu" else 0.0))

    def micro(x: Any, y: Any) -> tuple[Any, ...]:
        """One forward and backward: per block times, embeddings' and head's, per block CPU times."""
        time.sleep(idle)
        t0 = clock()
        loss = workload.loss(model(x), y)
        t1 = clock()
        time.sleep(idle)
        t1_backward = clock()
        loss.backward()
        t2 = clock()
        fwd = [stamps["f1", i] - stamps["f0", i] for i in range(n)]
        bwd = [stamps["b1", i] - stamps["b0", i] for i in range(n)]
        before = (stamps["f0", 0] - t0, t2 - stamps["b1", 0])
        after = (t1 - stamps["f1", n - 1], stamps["b0", n - 1] - t1_backward)
        fwd_cpu = [cpu["f1", i] - cpu["f0", i] for i in range(n)]
        bwd_cpu = [cpu["b1", i] - cpu["b0", i] for i in range(n)]
        return fwd, bwd, *before, *after, fwd_cpu, bwd_cpu

    def step() -> float:
        t2 = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock() - t2

    def iteration(x: Any, y: Any) -> tuple[Any, ...]:
        fwd, bwd, *rest, fwd_cpu, bwd_cpu = micro(x, y)
        return fwd, bwd, *rest, step(), fwd_cpu, bwd_cpu

    if shard > 1:
        return _measure_sharded(spec, workload, device, units, micro, step)

    sizes = [int(b) for b in spec["mbs"]]

    def timed(b: int) -> dict[str, Any]:
        """Medians of timed iterations at micro-batch size ``b``."""
        x, y = to_device(workload.synthetic_batch(b), device)  # seeded alike: every TP rank gets the same batch
        runs = []
        for _ in range(int(spec.get("warmup", 2))):
            iteration(x, y)
        began = time.perf_counter()
        while len(runs) < int(spec.get("min_reps", 5)) or (
            tp == 1 and time.perf_counter() - began < float(spec.get("seconds", 0.5)) and len(runs) < 50
        ):
            runs.append(iteration(x, y))
        rest = [median(r[j] for r in runs) for j in range(2, 7)]
        return {
            "fwd": [median(r[0][i] for r in runs) for i in range(n)],
            "bwd": [median(r[1][i] for r in runs) for i in range(n)],
            "embed": rest[0:2],
            "head": rest[2:4],
            "update": rest[4],
            "fwd_cpu": [median(r[7][i] for r in runs) for i in range(n)],
            "bwd_cpu": [median(r[8][i] for r in runs) for i in range(n)],
        }

    times: dict[str, Any] = {}
    for k, b in enumerate(sizes):
        times[str(b)] = timed(b)
        emit_progress(done=k + 1, total=len(sizes), mbs=b, seconds=sum(times[str(b)]["fwd"]))
    if tp > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
        return {"status": "ok", "times": times}
    measured = _sizes(torch, workload, model, blocks, optimizer, sizes[-1], device)
    # Every block checkpointed, as the runtime does it: what the recompute costs, the checkpointing's own work
    # included (on a CPU a checkpointed block's forward and backward cost more than f and f + g).
    from jabascli.engine.parallel.checkpointing import checkpoint_blocks

    checkpoint_blocks(blocks, range(n))
    for k, b in enumerate(sizes):
        again = timed(b)
        times[str(b)] |= {"fwd_ckpt": again["fwd"], "bwd_ckpt": again["bwd"]}
        emit_progress(done=k + 1, total=len(sizes), mbs=b, seconds=sum(again["fwd"]))
    return {"status": "ok", "times": times, **measured}


def _measure_sharded(spec: dict[str, Any], workload: Any, device: Any, units: list[Any], micro: Any, step: Any) -> dict:
    """Time two micro-batches and the update per iteration on the FSDP2 units (module docstring); medians."""
    import torch.distributed as dist

    from jabascli.engine.data import to_device

    def configure(sync: bool, reshard_backward: bool) -> None:
        for unit in units:  # as engine/parallel/sharding.py runs unequal micro-batch counts
            unit.set_requires_gradient_sync(sync, recurse=False)
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(reshard_backward, recurse=False)

    times: dict[str, Any] = {}
    sizes = [int(b) for b in spec["mbs"]]
    for k, b in enumerate(sizes):
        x, y = to_device(workload.synthetic_batch(b), device)
        runs = []
        # a fixed number of iterations on both ranks, so that their collectives pair up
        for rep in range(int(spec.get("warmup", 2)) + int(spec.get("min_reps", 5))):
            configure(sync=False, reshard_backward=False)
            first = micro(x, y)
            configure(sync=True, reshard_backward=True)
            last = micro(x, y)
            update = step()
            if rep >= int(spec.get("warmup", 2)):
                runs.append((first, last, update))
        n = len(runs[0][0][0])

        def med(which: int, field: int, runs: list[Any] = runs, n: int = n) -> list[float]:
            return [median(r[which][field][i] for r in runs) for i in range(n)]

        def med2(which: int, field: int, runs: list[Any] = runs) -> float:
            return median(r[which][field] for r in runs)

        times[str(b)] = {
            "fwd_first": med(0, 0),
            "fwd": med(1, 0),
            "bwd": med(0, 1),
            "bwd_last": med(1, 1),
            "fwd_first_cpu": med(0, 6),
            "fwd_cpu": med(1, 6),
            "bwd_cpu": med(0, 7),
            "bwd_last_cpu": med(1, 7),
            # embeddings and head: (forward, backward) of a micro-batch between first and last ones
            "embed": [med2(1, 2), med2(0, 3)],
            "head": [med2(1, 4), med2(0, 5)],
            "embed_once": [med2(0, 2) - med2(1, 2), med2(1, 3) - med2(0, 3)],
            "head_once": [med2(0, 4) - med2(1, 4), med2(1, 5) - med2(0, 5)],
            "update": median(r[2] for r in runs),
        }
        emit_progress(done=k + 1, total=len(sizes), mbs=b, seconds=sum(times[str(b)]["fwd"]))
    dist.destroy_process_group()
    return {"status": "ok", "times": times}


def _join_shard_group(spec: dict[str, Any], device: Any, model: Any, blocks: list[Any]) -> list[Any]:
    """Join the group of the sharded measurement and make every block, then the model, an FSDP2 unit over it."""
    from jabascli.engine.parallel.sharding import shard_model

    return shard_model(model, blocks, _join_group(spec, device, "dp"))


def _join_tp_group(spec: dict[str, Any], device: Any, blocks: list[Any], workload: Any) -> None:
    """Join the group of the TP measurement and split every block across it."""
    from jabascli.engine.parallel.tensor import parallelize_blocks

    parallelize_blocks(blocks, workload, _join_group(spec, device, "tp"))


def _join_group(spec: dict[str, Any], device: Any, dim: str) -> Any:
    """Join the measurement's process group (gloo on loopback, NCCL on GPUs); a one-dimensional mesh of it."""
    from torch.distributed.device_mesh import init_device_mesh

    join_group(spec, "nccl" if device.type == "cuda" else "gloo", device, timeout_s=120)
    return init_device_mesh(device.type, (int(spec["world_size"]),), mesh_dim_names=(dim,))


def _sizes(torch: Any, workload: Any, model: Any, blocks: list[Any], optimizer: Any, b: int, device: Any) -> dict:
    """Parameter, activation and output bytes per block, and optimizer state bytes per parameter byte."""
    from jabascli.engine.data import to_device

    n = len(blocks)
    in_block = {id(m) for blk in blocks for m in blk.modules()}
    phase = {"block": -1, "after": False}
    ran_before: set[int] = set()

    def outside(module: Any, args: Any) -> None:
        if phase["block"] < 0 and not phase["after"]:
            ran_before.add(id(module))

    hooks = [m.register_forward_pre_hook(outside) for m in model.modules() if id(m) not in in_block]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[dict[int, int]] = [{} for _ in range(n)]
    output = [0.0] * n

    def enter(i: int) -> Any:
        return lambda m, a: phase.__setitem__("block", i)

    def leave(i: int) -> Any:
        def hook(m: Any, a: Any, o: Any) -> None:
            phase["block"] = -1
            phase["after"] = i == n - 1
            output[i] = o.numel() * o.element_size() / b

        return hook

    def pack(t: Any) -> Any:
        # what the embeddings save counts with the first block, the head's and the loss's with the last (the
        # pipeline stages that hold them)
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            i = phase["block"] if phase["block"] >= 0 else (n - 1 if phase["after"] else 0)
            saved[i][storage.data_ptr()] = storage.nbytes()
        return t

    hooks += [blk.register_forward_pre_hook(enter(i)) for i, blk in enumerate(blocks)]
    hooks += [blk.register_forward_hook(leave(i)) for i, blk in enumerate(blocks)]
    x, y = to_device(workload.synthetic_batch(b), device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        loss = workload.loss(out, y)
    loss.backward()
    step_transient = _step_transient(torch, optimizer, device)
    optimizer.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    block_params = [sum(p.numel() * p.element_size() for p in blk.parameters()) for blk in blocks]
    own = list(block_params)
    owned = {id(p) for blk in blocks for p in blk.parameters()}
    for module in model.modules():
        if id(module) in in_block:
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in owned:
                block_params[0 if id(module) in ran_before else n - 1] += p.numel() * p.element_size()
                owned.add(id(p))
    state = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "params_bytes": block_params,
        "own_params_bytes": own,
        "act_bytes": [sum(s.values()) / b for s in saved],
        "boundary_bytes": output,
        "optimizer_bytes_per_param_byte": state / max(sum(block_params), 1),
        "step_bytes_per_param_byte": step_transient / max(sum(block_params), 1),
        "output_bytes": out.numel() * out.element_size() / b,
    }


def _step_transient(torch: Any, optimizer: Any, device: Any) -> float:
    """Bytes the optimizer step allocates and frees again, beyond the state it keeps (its peak over its end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))
    from jabascli.memtrack import TensorMemoryTracker

    with TensorMemoryTracker() as step:
        optimizer.step()
    return float(step.peak - step.live)


def measure_collectives(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world_size"])
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    with group(spec, "gloo", cpu, timeout_s=120):
        hosts = gather_hosts(spec["master_addr"], world, cpu)
        rows = []
        sizes = [int(s) for s in spec["sizes_bytes"]]
        for k, size in enumerate(sizes):
            count = max(world, size // 4 // world * world)
            data = torch.ones(count)
            part = torch.ones(count // world)
            for name in COLLECTIVES:

                def op(name: str = name, data: Any = data, part: Any = part) -> None:
                    _collective(dist, name, data, part, rank)

                taken = time_collective(op, cpu, int(spec.get("reps", 7)))
                rows.append({"collective": name, "size_bytes": count * 4, "seconds": median(taken)})
            if rank == 0:
                emit_progress(done=k + 1, total=len(sizes), size_bytes=count * 4)
        return {"status": "ok", "rows": rows, "hosts": hosts}


def _collective(dist: Any, name: str, data: Any, part: Any, rank: int) -> None:
    """``data``: what each rank holds whole (all-reduced, gathered into, reduce-scattered from); ``part``: its
    ``1/n`` share; ``send``: rank 0 to rank 1."""
    if name == "all_reduce":
        dist.all_reduce(data)
    elif name == "all_gather":
        dist.all_gather_into_tensor(data, part)
    elif name == "reduce_scatter":
        dist.reduce_scatter_tensor(part, data)
    elif rank == 0:
        dist.send(data, 1)
    elif rank == 1:
        dist.recv(data, 0)


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    return measure_blocks(spec) if spec["kind"] == "blocks" else measure_collectives(spec)


def main(argv: list[str] | None = None) -> int:
    return worker_main(sys.argv[1:] if argv is None else argv, _measure)


if __name__ == "__main__":
    sys.exit(main())
