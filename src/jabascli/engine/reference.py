"""The single-process reference: what an IIDP job must equal, written as plainly as possible.

Per iteration it takes the GBS samples the sampler deals, feeds them in
micro-batches of LBS in worker order (so BatchNorm sees the same per-micro-batch
statistics, and every micro-batch is drawn after the same seeding), accumulates
``loss / (GBS / LBS)``, and steps the optimizer and the LR scheduler once.
With ``[job] precision`` bf16/fp16 the forward runs under autocast and fp16
scales the loss (``GradScaler``: unscale, skip the step on inf/NaN); a clip
norm (``[job] clip_grad_norm`` or the workload's) clips the accumulated
gradient by its global norm before the step.
Tests compare trainers against it; it is also a readable statement of the
semantics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jabascli.config import LoadedConfig
from jabascli.engine.data import BatchLoader, seed_worker
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import IIDPSampler
from jabascli.engine.step_policy import PRECISIONS, step_settings
from jabascli.workload import load_workload


def reference_run(
    loaded: LoadedConfig, plan: TrainingPlan, steps: int, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train the config's workload for ``steps`` iterations at the plan's LBS and GBS, in one process."""
    device = torch.device(device)
    cfg = loaded.config
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    torch.manual_seed(cfg.job.seed)
    model = workload.build_model().to(device)
    optimizer = workload.optimizer(model.parameters())
    scheduler = workload.lr_scheduler(optimizer)
    settings = step_settings(cfg.job, workload)
    dtype = PRECISIONS[settings.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    dataset = workload.train_dataset()
    load = BatchLoader(dataset, device, workload.collate)
    sampler = IIDPSampler(len(dataset), cfg.job.seed)
    done, epoch = 0, 0
    while done < steps:
        for iteration in sampler.global_iterations(epoch, 0, plan):
            optimizer.zero_grad(set_to_none=True)
            for mb in iteration.micro_batches:
                seed_worker(mb.seed, device)
                inputs, target = load(mb.indices)
                with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                    loss: Any = workload.loss(output, target)
                scaler.scale(loss / plan.workers).backward()
            scaler.unscale_(optimizer)  # a no-op unless fp16
            if settings.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_grad_norm)
            scaler.step(optimizer)  # optimizer.step(), unless fp16 found an inf or NaN
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    return model, optimizer
