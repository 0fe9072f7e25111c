"""What every measuring child shares: its entry, its exit code, and joining its measurement's process group.

A child is ``python -m MODULE SPEC RESULT`` (or forked by the profiler's fork server, :mod:`.child`); its module's
``main(argv)`` is ``worker_main(argv, measure)``: the spec read from SPEC, ``measure(spec)`` run, its
result written to RESULT as JSON. The exit code says whether there is a measurement to read:

* 0: ``status`` ``ok``, or another outcome the parent reads from the result (``oom``: the trial did
  not fit; ``skip``: nothing to measure);
* 1: ``status`` ``error``, with the first line of what went wrong in ``error`` (an exception, or a
  result the measurement refused, a loss that is not finite). The parent reports it as the child said
  it (:class:`~jabascli.profiler.child.ChildCrashed`), and a non-zero exit ends the child's siblings at
  once (:func:`~jabascli.profiler.child.run_children`): they would wait for it in a collective.

A child that dies without a result (a signal, the OOM killer) exits otherwise, and the parent reports
the last line of its log.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

READ_BY_PARENT = ("ok", "oom", "skip")
"""The statuses of a measurement that ended with something to read (exit code 0)."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the error a child reports)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def worker_main(argv: list[str], measure: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Read the spec at ``argv[0]``, run ``measure`` on it, write its result to ``argv[1]``; the exit code."""
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        result = measure(spec)
    except Exception as exc:
        traceback.print_exc()
        result = {"status": "error", "error": first_line(exc)}
    Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
    return 0 if result.get("status") in READ_BY_PARENT else 1


def join_group(spec: dict[str, Any], backend: str, device: Any, timeout_s: float) -> None:
    """Join the measurement's process group: rank ``rank`` of ``world_size``, meeting at rank 0's store at
    ``master_addr:master_port``; gloo listens only where the other ranks reach this one. ``timeout_s``
    unless the spec gives ``timeout``."""
    import torch
    import torch.distributed as dist

    from jabascli.engine.distributed import bind_gloo_towards, rendezvous_store

    rank, world = int(spec["rank"]), int(spec["world_size"])
    timeout = timedelta(seconds=float(spec.get("timeout", timeout_s)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bind_gloo_towards(spec["master_addr"])
    store = rendezvous_store(spec["master_addr"], int(spec["master_port"]), rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


@contextlib.contextmanager
def group(spec: dict[str, Any], backend: str, device: Any, timeout_s: float) -> Iterator[None]:
    """:func:`join_group`, and the group destroyed when the block ends."""
    import torch.distributed as dist

    join_group(spec, backend, device, timeout_s)
    try:
        yield
    finally:
        dist.destroy_process_group()


def timed(op: Callable[[], None], device: Any) -> float:
    """Seconds of one run of the collective ``op``, started together on every rank (after a barrier); on a
    GPU timed by CUDA events."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)) / 1e3
    t0 = time.perf_counter()
    op()
    return time.perf_counter() - t0


def slowest(times: list[float], device: Any) -> list[float]:
    """Each repetition's time on the slowest rank (a collective is over when its slowest rank is done)."""
    import torch
    import torch.distributed as dist

    across = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(across, op=dist.ReduceOp.MAX)
    return [float(t) for t in across.cpu().tolist()]


def time_collective(op: Callable[[], None], device: Any, reps: int) -> list[float]:
    """Seconds of ``reps`` runs of the collective ``op``, each started together on every rank, each the slowest
    rank's: what ``jabas profile comm`` and the hybrid profile's collectives both measure."""
    return slowest([timed(op, device) for _ in range(reps)], device)


HOST_BYTES = 64


def gather_hosts(master_addr: str, world: int, device: Any) -> list[str]:
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
