"""Single-process training, until the IIDP engine runs the job on several trainers.

Trains the workload at one fixed global batch size,
``GBS = LBS * sum over devices of VSW * (GA + 1)``, one optimizer step per
global batch, and validates after every epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.workload import load_workload


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    train_loss: float
    val_loss: float | None
    val_accuracy: float | None


def fixed_gbs(loaded: LoadedConfig) -> tuple[int, int]:
    """(LBS, GBS) of a config without a plan."""
    cfg = loaded.config
    if cfg.job.lbs is None:
        raise InputError.at(loaded.path, "job.lbs", "a local batch size is needed to train without a plan")
    workers = sum(s.devices * s.vsw * (s.ga + 1) for s in cfg.available())
    if workers == 0:
        raise InputError.at(loaded.path, "cluster.servers", "no servers to train on")
    return cfg.job.lbs, cfg.job.lbs * workers


def train_single_process(
    loaded: LoadedConfig, on_step: Callable[[int, int, float], None] | None = None
) -> list[EpochResult]:
    cfg = loaded.config
    workload = load_workload(cfg.job.workload, cfg.job.options, cfg.job.data)
    _, gbs = fixed_gbs(loaded)
    torch.manual_seed(cfg.job.seed)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(cfg.job.seed)
    train = DataLoader(workload.train_dataset(), batch_size=gbs, shuffle=True, generator=generator, drop_last=True)
    val_set = workload.val_dataset()
    results = []
    for epoch in range(cfg.job.epochs):
        model.train()
        total = 0.0
        for step, (x, y) in enumerate(train):
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
            if on_step is not None:
                on_step(epoch, step, loss.item())
        val_loss, val_acc = (None, None) if val_set is None else _validate(workload, model, val_set)
        results.append(EpochResult(epoch, total / max(len(train), 1), val_loss, val_acc))
    return results


def _validate(workload, model, dataset) -> tuple[float, float | None]:  # type: ignore[no-untyped-def]
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=256):
            out = model(x)
            loss_sum += float(workload.loss(out, y)) * len(y)
            c = workload.count_correct(out, y)
            correct += c or 0
            seen += len(y)
    accuracy = correct / seen if workload.module.__dict__.get("count_correct") else None
    return loss_sum / seen, accuracy
