"""Handwritten digits: a small CNN on scikit-learn's bundled digits data.

The data is the UCI optical-recognition set that ships inside scikit-learn
(1,797 grey-scale 8x8 images of the digits 0-9, values 0..16), so this workload
trains on real data with no download. A fixed, seeded 80/20 split gives 1,437
training and 360 validation images.

The model has BatchNorm on purpose: it exercises jabas' per-micro-batch
BatchNorm semantics in every quickstart run.

Options: ``lr`` (0.05), ``momentum`` (0.9), ``weight_decay`` (1e-4),
``width`` (16 channels in the first convolution), ``optimizer`` (``sgd`` or
``adam``).
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from jabascli.builtin_models._classify import count_correct as count_correct
from jabascli.builtin_models._classify import loss as loss

NAME = "digits"
NUM_CLASSES = 10
VAL_FRACTION = 0.2
SPLIT_SEED = 0


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits(return_X_y=True)`` gives them, read from the file it ships
    without importing scikit-learn: that import costs about 2 CPU-seconds, paid by every trainer."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():  # another layout of scikit-learn: ask it
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


@cache
def _split() -> tuple[TensorDataset, TensorDataset]:
    images, labels = bundled_digits()
    x = torch.from_numpy((images / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(labels.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(y)))
    n_val = round(len(y) * VAL_FRACTION)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width * 4 * 4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def build_model(options: dict[str, Any]) -> nn.Module:
    return DigitsCNN(width=int(options.get("width", 16)))


def train_dataset(options: dict[str, Any]) -> TensorDataset:
    return _split()[0]


def val_dataset(options: dict[str, Any]) -> TensorDataset:
    return _split()[1]


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    lr = float(options.get("lr", 0.05))
    weight_decay = float(options.get("weight_decay", 1e-4))
    if options.get("optimizer", "sgd") == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=float(options.get("momentum", 0.9)), weight_decay=weight_decay)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 1, 8, 8), torch.randint(0, NUM_CLASSES, (batch_size,))
