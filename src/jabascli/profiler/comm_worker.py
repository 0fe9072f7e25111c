"""One process of the all-reduce measurement: ``python -m jabascli.profiler.comm_worker SPEC RESULT``.

The spec gives this process's rank, the world size, the rendezvous address,
the backend and the message sizes. For every size, after warm-up all-reduces,
rank 0 picks the number of timed repetitions (enough for about
``seconds_per_size``, within bounds) and tells the others; each repetition
starts after a barrier, so every rank times the same all-reduce. The times of
each repetition are combined across ranks with MAX, since an all-reduce is
over when its slowest rank is done; the median of those is the measurement.
Every rank ends with the same numbers; local rank 0 of each node writes them. Every rank also
learns every rank's own address (the one it reaches the master from, where gloo listens), so the
profile says between which hosts it was measured.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from jabascli.profiler.child import emit_progress
from jabascli.profiler.trial import summarize


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from jabascli.engine.distributed import bind_gloo_towards, rendezvous_store

    rank, world = int(spec["rank"]), int(spec["world_size"])
    backend = spec["backend"]
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if backend == "nccl":
        device = torch.device("cuda", int(spec["local_rank"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=float(spec.get("timeout", 300)))
    bind_gloo_towards(spec["master_addr"])  # listen only where the other ranks reach this one
    store = rendezvous_store(spec["master_addr"], int(spec["master_port"]), rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        hosts = _gather_hosts(spec["master_addr"], world, device)
        rows = []
        sizes = [int(s) for s in spec["sizes_bytes"]]
        for index, size in enumerate(sizes):
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            for _ in range(int(spec["warmup"])):
                _timed_allreduce(tensor, device)
            reps = torch.tensor([int(spec.get("reps") or 0)], dtype=torch.int64, device=device)
            if rank == 0 and not spec.get("reps"):
                probe = [_timed_allreduce(tensor, device) for _ in range(3)]
                per_rep_ms = max(sorted(probe)[1], 1e-6)
                wanted = int(float(spec["seconds_per_size"]) * 1e3 / per_rep_ms)
                reps[0] = min(max(wanted, int(spec["min_reps"])), int(spec["max_reps"]))
            elif not spec.get("reps"):
                for _ in range(3):
                    _timed_allreduce(tensor, device)
            dist.broadcast(reps, src=0)
            times = [_timed_allreduce(tensor, device) for _ in range(int(reps.item()))]
            slowest = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            row = summarize(slowest.cpu().tolist())
            if spec.get("after_wait_ms"):
                row["after_wait"] = _after_wait(tensor, device, rank, world, float(spec["after_wait_ms"]), len(times))
            rows.append({"size_bytes": tensor.numel() * 4, "reps": len(times), **row})
            if rank == 0:
                emit_progress(done=index + 1, total=len(sizes), size_bytes=size, median_ms=row["median"])
        return {"status": "ok", "rows": rows, "hosts": hosts}
    finally:
        dist.destroy_process_group()


HOST_BYTES = 64


def _gather_hosts(master_addr: str, world: int, device: Any) -> list[str]:
    """Every rank's address towards ``master_addr``, by rank (fixed-size bytes, never a pickle)."""
    import torch
    import torch.distributed as dist

    from jabascli.net import local_address_towards

    own = (local_address_towards(master_addr) or "?").encode()[:HOST_BYTES]
    mine = torch.zeros(HOST_BYTES, dtype=torch.uint8, device=device)
    mine[: len(own)] = torch.tensor(list(own), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in every]


def _after_wait(tensor: Any, device: Any, rank: int, world: int, wait_ms: float, reps: int) -> float:
    """Median ms of an all-reduce entered by the last rank ``wait_ms`` after the others, timed on the last rank.

    So it runs in training: the ranks that finished their backward first wait,
    blocked, inside the all-reduce, and the last to arrive pays for waking them.
    """
    import torch
    import torch.distributed as dist

    last = world - 1
    times = []
    for _ in range(max(5, reps // 2)):
        dist.barrier()
        if rank == last:
            time.sleep(wait_ms / 1e3)
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        times.append((time.perf_counter() - t0) * 1e3)
    median = torch.tensor([summarize(times)["median"] if rank == last else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _timed_allreduce(tensor: Any, device: Any) -> float:
    """One all-reduce, started together on every rank; milliseconds."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(tensor)
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    dist.all_reduce(tensor)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        result = measure(spec)
    except Exception as exc:
        traceback.print_exc()
        lines = str(exc).strip().splitlines()
        result = {"status": "error", "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"}
        Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
        return 1
    Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
