"""Bucket profiler: the gradient buckets DDP actually forms for the model.

The model is wrapped in ``DistributedDataParallel`` (in a one-process gloo
group, on the CPU: bucket assignment depends on the parameters' sizes and the
order their gradients become ready, not on the device) with the configured
``bucket_cap_mb``, and a communication hook records the size of every
``GradBucket`` in the order DDP hands them over during backward. DDP forms
its buckets from the reverse parameter order at construction and rebuilds
them from the gradient-ready order observed in the first iteration, so the
buckets are recorded in a later iteration (and checked to stay the same in
the one after).

Sizes are MiB, DDP's (and the seed's) meaning of MB. With its default cap
(25 MiB, ``bucket_cap_mb`` not given), DDP deliberately keeps the first bucket
small (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB) so that
communication starts early; recent PyTorch versions drop that small first
bucket when a cap is given explicitly, even 25. The profiler builds DDP the
same way the trainer does: without ``bucket_cap_mb`` unless one is given, and
reports what DDP forms. A bucket closes once it reaches its cap, so buckets may
exceed it by up to one parameter's gradient. For ResNet-50 with the default
this gives ``[7.82, 30.04, 25.04, 25.32, 9.27]``, the seed's published
``[7.81, 30.04, 25.04, 25.25, 9.2]``.

Writes ``<out>/<model>_bucket_size_profile.json`` with
``bucket_size_distribution`` (the seed's field) and ``bucket_cap_mb`` (jabas's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.config.loader import LoadedConfig
from jabascli.errors import InputError, RuntimeFailure
from jabascli.profiler.common import Reporter, ensure_writable, job_workload
from jabascli.profiles.formats import BUCKET_MB, BucketProfile, bucket_profile_path, write_bucket_profile
from jabascli.profiles.formats import read_bucket_profile as _read

BATCH_SIZE = 2  # the smallest batch BatchNorm accepts in training mode; sizes do not depend on it


@dataclass
class BucketRun:
    profile: BucketProfile
    path: Path
    skipped: bool = False


def profile_buckets(
    loaded: LoadedConfig,
    *,
    out: Path | None = None,
    bucket_cap_mb: float | None = None,
    force: bool = False,
    reporter: Reporter | None = None,
) -> BucketRun:
    """Measure DDP's buckets for the job's model and write the bucket profile."""
    reporter = reporter or Reporter()
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise InputError.at(None, "--bucket-cap-mb", f"must be positive, got {bucket_cap_mb}")
    workload, _ = job_workload(loaded)
    folder = ensure_writable(Path(out) if out is not None else loaded.profile_dirs().bucket)
    path = bucket_profile_path(folder, workload.name)
    if path.is_file() and not force:
        reporter.note(f"already profiled ({path})")
        return BucketRun(_read(folder, workload.name), path, skipped=True)
    cap = "DDP's default cap" if bucket_cap_mb is None else f"cap {bucket_cap_mb:g} MB"
    reporter.progress(0, 1, f"{workload.name}: backward passes under DDP ({cap})")
    try:
        sizes, effective_cap = ddp_bucket_sizes(workload, bucket_cap_mb)
    except RuntimeFailure:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RuntimeFailure([f"{workload.path}: the model failed under DDP: {type(exc).__name__}: {first}"]) from None
    profile = BucketProfile(model=workload.name, bucket_size_distribution=sizes, bucket_cap_mb=effective_cap)
    written = write_bucket_profile(folder, profile)
    reporter.progress(1, 1, f"{workload.name}: {len(sizes)} buckets")
    reporter.note(f"{len(sizes)} bucket{'s' if len(sizes) != 1 else ''}, {sum(sizes):.2f} MB in all")
    return BucketRun(profile, written)


def ddp_bucket_sizes(workload: Any, bucket_cap_mb: float | None, iterations: int = 3) -> tuple[list[float], float]:
    """Bucket sizes in MiB, in the order DDP reduces them (gradient-ready order), and DDP's cap in MiB."""
    try:
        return _bucket_sizes(workload, bucket_cap_mb, iterations, find_unused_parameters=False)
    except RuntimeError as exc:
        if "Expected to have finished reduction" not in str(exc):
            raise
        # Some parameters get no gradient in an iteration: DDP has to look for them.
        return _bucket_sizes(workload, bucket_cap_mb, iterations, find_unused_parameters=True)


def _bucket_sizes(
    workload: Any, bucket_cap_mb: float | None, iterations: int, find_unused_parameters: bool
) -> tuple[list[float], float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        raise RuntimeFailure(["the bucket profiler needs its own process group, but one is already initialised"])
    seen: list[int] = []
    per_iteration: list[list[int]] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = workload.build_model()
        model.train()
        cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}  # as a trainer would build it
        ddp = DistributedDataParallel(model, find_unused_parameters=find_unused_parameters, **cap)

        # No annotations: DDP rejects a hook whose bucket is annotated other than dist.GradBucket.
        def record(state, bucket):  # type: ignore[no-untyped-def]
            buffer = bucket.buffer()
            seen.append(buffer.numel() * buffer.element_size())
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(buffer)
            return future

        ddp.register_comm_hook(None, record)
        effective_cap = ddp.bucket_bytes_cap / BUCKET_MB
        for _ in range(iterations):
            seen.clear()
            inputs, target = workload.synthetic_batch(BATCH_SIZE)
            output = ddp(*inputs) if isinstance(inputs, tuple) else ddp(inputs)
            workload.loss(output, target).backward()
            ddp.zero_grad(set_to_none=True)
            per_iteration.append(list(seen))
    finally:
        dist.destroy_process_group()
    settled = per_iteration[1:]
    if any(sizes != settled[0] for sizes in settled):
        raise RuntimeFailure([f"DDP's buckets changed between iterations: {per_iteration}"])
    if not settled[0]:
        raise RuntimeFailure(["DDP formed no gradient buckets: does the model have trainable parameters?"])
    return [size / BUCKET_MB for size in settled[0]], effective_cap
