"""The single-process reference: what an IIDP job must equal, written as plainly as possible.

Per iteration it takes the GBS samples the sampler deals, feeds them in
micro-batches of LBS in worker order (so BatchNorm sees the same per-micro-batch
statistics, and every micro-batch is drawn after the same seeding), accumulates
``loss / (GBS / LBS)``, and steps the optimizer and the LR scheduler once.
Tests compare trainers against it; it is also a readable statement of the
semantics.

With a ``schedule`` (a checkpoint's ``gbs_history``: from iteration ``step`` on,
GBS ``gbs`` in micro-batches of ``lbs``, LR factor ``lr_factor``) it follows an
adaptive job: every iteration still takes the next GBS samples of the epoch's
permutation at the position the previous one left, and an epoch ends when
fewer than the current GBS samples are left (the remainder rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jabascli.adaptive.lr_scaling import ScaledLr
from jabascli.config import LoadedConfig
from jabascli.engine.data import BatchLoader, seed_worker
from jabascli.engine.plan import TrainingPlan
from jabascli.engine.sampler import IIDPSampler
from jabascli.workload import load_workload


def reference_run(
    loaded: LoadedConfig, plan: TrainingPlan, steps: int, schedule: Sequence[dict[str, Any]] | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train the config's workload for ``steps`` iterations at the plan's LBS and GBS (or ``schedule``'s)."""
    cfg = loaded.config
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    torch.manual_seed(cfg.job.seed)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    lr = ScaledLr(optimizer, workload.lr_scheduler(optimizer))
    dataset = workload.train_dataset()
    load = BatchLoader(dataset, torch.device("cpu"), workload.collate)
    sampler = IIDPSampler(len(dataset), cfg.job.seed)
    schedule = schedule or [{"step": 0, "gbs": plan.gbs, "lbs": plan.lbs, "lr_factor": 1.0}]
    done, epoch, position = 0, 0, 0
    perm = sampler.permutation(epoch)
    while done < steps:
        now = [e for e in schedule if e["step"] <= done][-1]
        lbs, gbs = now["lbs"], now["gbs"]
        if sampler.iterations_left(position, gbs) == 0:
            epoch, position = epoch + 1, 0
            perm = sampler.permutation(epoch)
            continue
        lr.set_factor(now.get("lr_factor", 1.0))
        optimizer.zero_grad(set_to_none=True)
        for w in range(gbs // lbs):
            at = position + w * lbs
            seed_worker(sampler.worker_seed(epoch, at), torch.device("cpu"))
            inputs, target = load(perm[at : at + lbs])
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            loss: Any = workload.loss(output, target)
            (loss / (gbs // lbs)).backward()
        optimizer.step()
        lr.step()
        position += gbs
        done += 1
    return model, optimizer
