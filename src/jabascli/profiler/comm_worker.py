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

import sys
import time
from typing import Any

from jabascli.profiler.child import emit_progress
from jabascli.profiler.trial import summarize
from jabascli.profiler.worker import gather_hosts, group, slowest, time_collective, timed, worker_main


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world_size"])
    backend = spec["backend"]
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if backend == "nccl":
        device = torch.device("cuda", int(spec["local_rank"]) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    with group(spec, backend, device, timeout_s=300):
        hosts = gather_hosts(spec["master_addr"], world, device)
        rows = []
        sizes = [int(s) for s in spec["sizes_bytes"]]
        for index, size in enumerate(sizes):
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)

            def allreduce(tensor: Any = tensor) -> None:
                dist.all_reduce(tensor)

            for _ in range(int(spec["warmup"])):
                timed(allreduce, device)
            reps = torch.tensor([int(spec.get("reps") or 0)], dtype=torch.int64, device=device)
            if rank == 0 and not spec.get("reps"):
                probe = [timed(allreduce, device) * 1e3 for _ in range(3)]
                per_rep_ms = max(sorted(probe)[1], 1e-6)
                wanted = int(float(spec["seconds_per_size"]) * 1e3 / per_rep_ms)
                reps[0] = min(max(wanted, int(spec["min_reps"])), int(spec["max_reps"]))
            elif not spec.get("reps"):
                for _ in range(3):
                    timed(allreduce, device)
            dist.broadcast(reps, src=0)
            count = int(reps.item())
            row = summarize([t * 1e3 for t in time_collective(allreduce, device, count)])
            if spec.get("after_wait_ms"):
                row["after_wait"] = _after_wait(tensor, device, rank, world, float(spec["after_wait_ms"]), count)
            rows.append({"size_bytes": tensor.numel() * 4, "reps": count, **row})
            if rank == 0:
                emit_progress(done=index + 1, total=len(sizes), size_bytes=size, median_ms=row["median"])
        return {"status": "ok", "rows": rows, "hosts": hosts}


def _after_wait(tensor: Any, device: Any, rank: int, world: int, wait_ms: float, reps: int) -> float:
    """Median ms of an all-reduce entered by the last rank ``wait_ms`` after the others, timed on the last rank.

    So it runs in training: the ranks that finished their backward first wait,
    blocked, inside the all-reduce, and the last to arrive pays for waking them.
    """
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
    return slowest([summarize(times)["median"] if rank == last else 0.0], device)[0]


def main(argv: list[str]) -> int:
    return worker_main(argv, measure)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
