"""Shared by the engine tests: a tiny workload with BatchNorm and dropout, and job files for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomli_w
import torch

from jabascli.config import LoadedConfig, load_config

# Small enough for 2 busy CPU cores; BatchNorm to test the running statistics, dropout to
# test that every worker's random numbers follow its samples, a scheduler to test its step.
WORKLOAD = """
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

NAME = "tiny"
FEATURES, CLASSES = 6, 4
_OPTIONS = {}
_LOSSES = [0]


def _dtype(options):
    return torch.float64 if options.get("dtype", "float64") == "float64" else torch.float32


class Counter(nn.Module):
    # A buffer that is not BatchNorm's: samples seen by this replica (differs between ranks).

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
        return x


def build_model(options):
    _OPTIONS.update(options)
    if options.get("counter"):
        return nn.Sequential(Counter(), _layers(options)).to(_dtype(options))
    return _layers(options)


def _layers(options):
    model = nn.Sequential(
        nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(options.get("dropout", 0.2)),
        nn.Linear(16, 12), nn.BatchNorm1d(12, momentum=options.get("bn_momentum", 0.1)), nn.ReLU(),
        nn.Linear(12, CLASSES),
    )
    return model.to(_dtype(options))


class Recorded(TensorDataset):
    # With option "record" (a folder), each trainer appends the index of every sample it loads to
    # record-<RANK>.txt ("t <index>" for training, "v" for validation: validation separates epochs).

    def __init__(self, x, y, folder, kind):
        super().__init__(x, y)
        rank = os.environ.get("RANK")
        self.path = os.path.join(folder, f"record-{rank}.txt") if folder and rank is not None else None
        self.kind = kind

    def __getitem__(self, i):
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(f"{self.kind} {i}\\n" if self.kind == "t" else "v\\n")
        return super().__getitem__(i)


def _data(n, seed, options, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64).to(_dtype(options))
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if options.get("learnable"):  # labels a function of the features: early gradients agree across samples
        w = torch.linspace(-1, 1, FEATURES * CLASSES, dtype=torch.float64).view(FEATURES, CLASSES)
        y = (x.double() @ w).argmax(1)
    return Recorded(x, y, options.get("record"), kind)


class Augmented(torch.utils.data.Dataset):
    # Random augmentation from all three generators a worker seeds: it must follow the samples.

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        shift = random.random() + float(np.random.rand())
        return x + 0.1 * torch.randn(x.shape, dtype=x.dtype) + 0.01 * shift, y


def train_dataset(options):
    data = _data(int(options.get("samples", 250)), 1, options, "t")
    if options.get("inf_sample") is not None:
        data.tensors[1][options["inf_sample"]] = CLASSES  # marks the sample whose loss is made infinite
    return Augmented(data) if options.get("augment") else data


def val_dataset(options):
    return _data(50, 2, options, "v")


def loss(output, target):
    _LOSSES[0] += 1
    if _OPTIONS.get("sleep"):  # slower iterations, for tests that steer a running job
        time.sleep(_OPTIONS["sleep"])
    crash = _OPTIONS.get("crash_rank")
    if crash is not None and os.environ.get("RANK") == str(crash) and _LOSSES[0] > _OPTIONS.get("crash_after", 0):
        raise RuntimeError(f"boom on rank {crash}")
    if bool((target == CLASSES).any()):  # an injected inf: the whole micro-batch's gradient is not finite
        return F.cross_entropy(output, target.clamp(max=CLASSES - 1)) * float("inf")
    return F.cross_entropy(output, target)


def count_correct(output, target):
    return int((output.argmax(1) == target).sum())


def optimizer(params, options):
    if options.get("optimizer", "sgd") == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def lr_scheduler(optimizer, options):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)


def synthetic_batch(batch_size, options):
    return torch.randn(batch_size, FEATURES, dtype=_dtype(options)), torch.randint(0, CLASSES, (batch_size,))
"""

# Threads: one per trainer (the machine is shared); all tests pass this to the launcher.
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_job(
    folder: Path,
    ranks: list[tuple[int, int]],
    *,
    lbs: int = 4,
    name: str = "job",
    epochs: int = 2,
    options: dict[str, Any] | None = None,
    weight_sync: str = "sequential",
    vsw_strategy: str = "sequential",
    plan_file: bool = False,
    servers: list[dict[str, Any]] | None = None,
    job_keys: dict[str, Any] | None = None,
    batching: dict[str, Any] | None = None,
) -> Path:
    """A config (and, with ``plan_file``, a plan) whose ranks run the given (VSW, GA); returns the config path."""
    folder.mkdir(parents=True, exist_ok=True)
    workload = folder / "tiny.py"
    if not workload.exists():
        workload.write_text(WORKLOAD)
    if servers is None:
        servers = [
            {"name": f"s{i}", "device_type": "cpu", "devices": 1, "vsw": vsw, "ga": ga}
            for i, (vsw, ga) in enumerate(ranks)
        ]
    job: dict[str, Any] = {
        "name": name,
        "workload": str(workload),
        "epochs": epochs,
        "seed": 7,
        "lbs": lbs,
        "weight_sync": weight_sync,
        "vsw_strategy": vsw_strategy,
        "options": options or {},
        **(job_keys or {}),
    }
    if plan_file:
        workers = sum(v * (g + 1) for v, g in ranks)
        assignments = [
            {"server": s["name"], "device_type": "cpu", "gpus": 1, "vsw": v, "ga": g}
            for s, (v, g) in zip(servers, ranks, strict=True)
        ]
        plan = {"gbs": lbs * workers, "lbs": lbs, "weight_sync": weight_sync, "assignments": assignments}
        (folder / f"{name}-plan.json").write_text(json.dumps(plan))
        job["plan"] = str(folder / f"{name}-plan.json")
    config = {
        "job": job,
        "cluster": {"servers": servers},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    if batching is not None:
        config["batching"] = batching
    path = folder / f"{name}.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def checkpoint_of(loaded: LoadedConfig) -> dict[str, Any]:
    """The job's newest checkpoint, read as any torch.save file is (not through jabas's own reader)."""
    from jabascli.engine.checkpoint_store import newest_checkpoint
    from jabascli.engine.layout import checkpoint_folder

    found = newest_checkpoint(checkpoint_folder(loaded))
    assert found is not None, f"no checkpoint in {checkpoint_folder(loaded)}"
    return torch.load(found.path, map_location="cpu", weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per state-dict entry, the largest absolute difference (exact integer buffers must match)."""
    assert a.keys() == b.keys()
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}


def load(path: Path) -> LoadedConfig:
    return load_config(path)
