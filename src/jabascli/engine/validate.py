"""Validation: the loss and accuracy of the model over the validation set, shared out over the ranks.

Each rank takes a share of the set proportional to its workers (a layout's replica: its ranks together,
the outputs counted where the replica's output is), evaluates it in batches of its VSWs' samples, and
one all-reduce sums loss, correct answers and samples, so that every rank returns the same figures,
whatever the split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jabascli.engine.buffers import allreduce_sum
from jabascli.engine.data import BatchLoader, batch_len
from jabascli.engine.plan import TrainingPlan
from jabascli.workload import Workload


def validate(
    model: nn.Module,
    val_set: Any,
    workload: Workload,
    vsw: Any,
    plan: TrainingPlan,
    rank: int,
    replica_ranks: list[int],
    device: torch.device,
) -> tuple[float | None, float | None]:
    """Mean loss and accuracy (None without ``count_correct``) over ``val_set``; a collective of every rank.

    ``model`` is put in eval mode meanwhile; ``vsw``: this rank's workers (a VSW strategy, or a layout's),
    which run the forward.
    """
    n = len(val_set)
    offset, workers = vsw.share(plan, rank)  # a layout's replica: its ranks together
    lo = n * offset // plan.workers
    hi = n * (offset + workers) // plan.workers
    batch = plan.lbs * plan.rank(replica_ranks[0]).vsw  # the same on every rank of a replica
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    has_accuracy = callable(getattr(workload.module, "count_correct", None))
    load = BatchLoader(val_set, device, workload.collate)
    model.eval()
    try:
        with torch.no_grad(), vsw.evaluating():
            for start in range(lo, hi, batch):
                inputs, target = load(range(start, min(start + batch, hi)))
                output = vsw.forward(inputs)
                if output is None:  # counted where the replica's output is (a layout's last stage)
                    continue
                count = batch_len(target)
                totals[0] += float(workload.loss(output, target)) * count
                if has_accuracy:
                    totals[1] += workload.count_correct(output, target) or 0
                totals[2] += count
    finally:
        model.train()
    allreduce_sum([totals])
    loss_sum, correct, seen = totals.tolist()
    if seen == 0:
        return None, None
    return loss_sum / seen, (correct / seen if has_accuracy else None)
