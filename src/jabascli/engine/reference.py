"""The single-process reference: what an IIDP job must equal, written as plainly as possible.

Per iteration it takes the GBS samples the sampler deals, feeds them in
micro-batches of LBS in worker order (so BatchNorm sees the same per-micro-batch
statistics, and every micro-batch is drawn after the same seeding), accumulates
``loss / (GBS / LBS)``, and steps the optimizer and the LR scheduler once.
An uneven plan's micro-batches (``sizes``, in worker order) each weigh
``size / GBS``: ``loss * (size * W / GBS) / W``, as the trainers compute it.
With ``[job] precision`` bf16/fp16 the forward runs under autocast and fp16
scales the loss (``GradScaler``: unscale, skip the step on inf/NaN); a clip
norm (``[job] clip_grad_norm`` or the workload's) clips the accumulated
gradient by its global norm before the step.
Tests compare trainers against it; it is also a readable statement of the
semantics.

With a ``schedule`` (a checkpoint's ``gbs_history``: from iteration ``step`` on,
GBS ``gbs`` in micro-batches of ``lbs``, LR factor ``lr_factor``) it follows an
adaptive job: every iteration still takes the next GBS samples of the epoch's
permutation at the position the previous one left, and an epoch ends when
fewer than the current GBS samples are left (the remainder rule). With
``halves_every`` it also measures, as plainly, what an adaptive job's
measurement iterations measure: the gradient of the first ``floor(W/2)``
workers and the full gradient (:class:`~jabascli.adaptive.estimators.HalfGradients`),
before clipping and without fp16's loss scale, as the trainers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jabascli.adaptive.batching import HalfGradients, ScaledLr, half_split
from jabascli.config import LoadedConfig
from jabascli.engine.data import BatchLoader, seed_worker
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import IIDPSampler
from jabascli.engine.step_policy import PRECISIONS, step_settings
from jabascli.workload import workload_of


def reference_run(
    loaded: LoadedConfig,
    plan: TrainingPlan,
    steps: int,
    schedule: Sequence[dict[str, Any]] | None = None,
    halves_every: int | None = None,
    halves: dict[int, HalfGradients] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train the config's workload for ``steps`` iterations at the plan's LBS and GBS (or ``schedule``'s).

    With ``halves_every``, ``halves[step]`` gets the measurement of every iteration that completes a
    multiple of it (``step`` iterations done): of the gradient before clipping, with fp16's loss
    scale divided out.
    """
    device = torch.device(device)
    cfg = loaded.config
    workload = workload_of(loaded)
    torch.manual_seed(cfg.job.seed)
    model = workload.build_model().to(device)
    optimizer = workload.optimizer(model.parameters())
    lr = ScaledLr(optimizer, workload.lr_scheduler(optimizer))
    settings = step_settings(cfg.job, workload)
    dtype = PRECISIONS[settings.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    dataset = workload.train_dataset()
    load = BatchLoader(dataset, device, workload.collate)
    sampler = IIDPSampler(len(dataset), cfg.job.seed)
    sizes = plan.micro_batch_sizes()
    schedule = schedule or [{"step": 0, "gbs": plan.gbs, "lbs": plan.lbs, "sizes": sizes, "lr_factor": 1.0}]
    done, epoch, position = 0, 0, 0
    perm = sampler.permutation(epoch)
    while done < steps:
        now = [e for e in schedule if e["step"] <= done][-1]
        lbs, gbs = now["lbs"], now["gbs"]
        if now["step"] == done and (now.get("epoch", epoch), now.get("position", position)) > (epoch, position):
            # A change recorded at an epoch end starts the next epoch there: the old epoch's remainder, too
            # short for the old GBS, may hold an iteration of the new one, which the job did not train.
            epoch, position = now["epoch"], now.get("position", 0)
            perm = sampler.permutation(epoch)
        if sampler.iterations_left(position, gbs) == 0:
            epoch, position = epoch + 1, 0
            perm = sampler.permutation(epoch)
            continue
        lr.set_factor(now.get("lr_factor", 1.0))
        optimizer.zero_grad(set_to_none=True)
        sizes = now.get("sizes") or [lbs] * (gbs // lbs)
        workers = len(sizes)
        measuring = halves is not None and halves_every is not None and (done + 1) % halves_every == 0
        first: torch.Tensor | None = None
        at = position
        for w, size in enumerate(sizes):
            seed_worker(sampler.worker_seed(epoch, at), device)
            inputs, target = load(perm[at : at + size])
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                loss: Any = workload.loss(output, target)
                weight = size * workers / gbs
                if weight != 1.0:
                    loss = loss * weight
            scaler.scale(loss / workers).backward()
            if measuring and w == half_split(workers) - 1:
                first = _flat_grad(model)
            at += size
        if halves is not None and first is not None:
            f, t = first, _flat_grad(model)
            scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
            measured = HalfGradients(float(f @ f), float(f @ t), float(t @ t), workers, lbs)
            halves[done + 1] = measured.unscaled(scale)
        scaler.unscale_(optimizer)  # a no-op unless fp16
        if settings.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_grad_norm)
        scaler.step(optimizer)  # optimizer.step(), unless fp16 found an inf or NaN
        scaler.update()
        lr.step()
        position += gbs
        done += 1
    return model, optimizer


def _flat_grad(model: nn.Module) -> torch.Tensor:
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in grads]).to(torch.float64)
