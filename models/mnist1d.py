"""MNIST-1D: the paper's small 1-D CNN on procedurally generated digits.

MNIST-1D (Greydanus and Kobak, "Scaling Down Deep Learning with MNIST-1D",
ICML 2024) turns ten hand-drawn 1-D templates, one per digit, into 40-point
signals: each sample is a template padded with zeros, stretched, scaled,
shifted, given correlated and i.i.d. noise, sheared and resampled. It is a real
classification problem (a linear model reaches about 32 %, the paper's CNN
about 94 % on 4,000 training samples) that a CPU trains in minutes, with as
many samples as asked for: a batch-size experiment can run hundreds of
iterations per epoch even at large global batch sizes, which the 1,437 digits
of the quick start cannot.

Data: the ``mnist1d`` package's own generator, ``mnist1d.data.make_dataset``,
with its default arguments except ``num_samples = train_samples +
val_samples`` (rounded up to a multiple of 10: it makes ``num_samples // 10``
samples of each digit) and ``seed = data_seed``. It shuffles the samples and
normalises them over the whole set; the first ``train_samples`` are the
training set, the next ``val_samples`` the validation set. With the ``paper``
variant (4,000 + 1,000, seed 42) these are exactly the package's default
training and test sets. Nothing is downloaded: the package's ``get_dataset``
(which fetches a pickle over the network and unpickles it) is never called.

Generation takes 6 to 27 s for 44,000 samples here (one core, shared), and
every trainer process needs the data, so the arrays are kept in memory per
process and cached on disk as
``mnist1d-<samples>-seed<seed>-<package version>.npz`` (float32 signals, int64
labels, read with ``allow_pickle=False``) in the folder ``[job] data`` when it
is set, else in ``$XDG_CACHE_HOME/jabas`` (default ``~/.cache/jabas``). The
first process to lock the folder generates and writes the file atomically; the
trainers beside it wait and read it. A file that does not read back as the
expected arrays is regenerated and replaced; a folder that cannot be written
only costs the regeneration. The generator seeds NumPy's and Python's global
random state (the legacy ``RandomState``, whose streams NumPy keeps stable
across versions); both are restored afterwards.

Model: the paper's ``ConvBase``: three 1-D convolutions with ReLU (kernel 5,
then 3 and 3, each stride 2 with padding 1: 40 -> 19 -> 10 -> 5 positions) of
``width`` channels and a linear classifier on the flattened 5 x ``width``
features. Width 25 gives the paper's 5,210 parameters. The paper trains it
with Adam (learning rate 1e-2, no weight decay) at batch size 100.

Options (``[job] options``), with their defaults for ``mnist1d`` / ``paper`` /
``tiny``:

- ``train_samples`` (40,000 / 4,000 / 800), ``val_samples`` (4,000 / 1,000 /
  200): the sizes of the generated sets; ``val_samples = 0``: no validation.
- ``data_seed`` (42): the generator's seed (``[job] seed`` seeds the model and
  the sampler, not the data).
- ``width`` (25): channels of every convolution.
- ``optimizer`` (``adam``), ``lr`` (1e-2), ``weight_decay`` (0), ``momentum``
  (0.9, SGD only): the learning rate at the initial global batch size.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from jabascli.atomic import atomic_write
from jabascli.builtin_models._classify import count_correct as count_correct
from jabascli.builtin_models._classify import loss as loss
from jabascli.builtin_models._options import Spec, resolve
from jabascli.errors import InputError

NAME = "mnist1d"
NUM_CLASSES = 10
LENGTH = 40
"""Points per signal: the generator's ``final_seq_length``."""

SPECS = {
    "train_samples": Spec(int, "generated training samples", minimum=1),
    "val_samples": Spec(int, "generated validation samples (0: no validation)", minimum=0),
    "data_seed": Spec(int, "seed of the data generator", minimum=0),
    "width": Spec(int, "channels of every convolution", minimum=1),
    "optimizer": Spec(str, "the optimizer", choices=("adam", "sgd")),
    "lr": Spec(float, "learning rate at the initial global batch size", minimum=0),
    "weight_decay": Spec(float, "L2 penalty", minimum=0),
    "momentum": Spec(float, "SGD momentum", minimum=0),
}
_COMMON = {"data_seed": 42, "width": 25, "optimizer": "adam", "lr": 1e-2, "weight_decay": 0.0, "momentum": 0.9}
VARIANTS: dict[str, dict[str, Any]] = {
    "mnist1d": {"train_samples": 40_000, "val_samples": 4_000, **_COMMON},
    "paper": {"train_samples": 4_000, "val_samples": 1_000, **_COMMON},
    "tiny": {"train_samples": 800, "val_samples": 200, **_COMMON},
}


def settings(options: dict[str, Any]) -> Any:
    s = resolve(options, SPECS, VARIANTS, "mnist1d")
    if s.data_seed >= 2**32:  # the generator seeds NumPy's legacy RandomState
        raise InputError.at(None, "job.options.data_seed", f"must be below 2**32, got {s.data_seed}")
    return s


def cache_folder(data: Path | None) -> Path:
    """Where the generated arrays are cached: ``[job] data``, else the user's cache folder."""
    if data is not None:
        if not Path(data).is_dir():
            raise InputError.at(None, "job.data", f"{data} is not a folder (mnist1d caches its generated data there)")
        return Path(data)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jabas"


def generate(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``num_samples`` signals (float32, ``(n, 40)``) and labels (int64), in the generator's shuffled order."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        made = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    x = np.concatenate([made["x"], made["x_test"]]).astype(np.float32)
    y = np.concatenate([made["y"], made["y_test"]]).astype(np.int64)
    return x, y


def _read(path: Path, num_samples: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays, or None when the file is missing or not what :func:`generate` writes."""
    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if x.shape != (num_samples, LENGTH) or x.dtype != np.float32 or y.shape != (num_samples,) or y.dtype != np.int64:
        return None
    if not np.isfinite(x).all() or y.min() < 0 or y.max() >= NUM_CLASSES:
        return None
    return x, y


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``folder``, so that the trainers of one machine generate once, not each.

    The lock is ``flock`` on the folder itself: nothing is left behind, and the
    kernel releases it when a holder dies. Without a folder to lock, no lock.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@cache
def arrays(num_samples: int, seed: int, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated samples as tensors ``(n, 1, 40)`` and ``(n,)``: from memory, the cache file, or the generator."""
    from importlib.metadata import version

    path = folder / f"mnist1d-{num_samples}-seed{seed}-{version('mnist1d')}.npz"
    with _locked(folder):
        cached = _read(path, num_samples)
        if cached is None:
            cached = generate(num_samples, seed)
            x, y = cached
            # A cache that cannot be written only costs the regeneration next time.
            with contextlib.suppress(OSError):
                atomic_write(path, lambda f: np.savez(f, x=x, y=y))
    x, y = cached
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)


def _split(options: dict[str, Any]) -> tuple[TensorDataset, TensorDataset | None]:
    s = settings(options)
    wanted = s.train_samples + s.val_samples
    x, y = arrays(-(-wanted // NUM_CLASSES) * NUM_CLASSES, s.data_seed, cache_folder(s.data))
    train = TensorDataset(x[: s.train_samples], y[: s.train_samples])
    val = TensorDataset(x[s.train_samples : wanted], y[s.train_samples : wanted]) if s.val_samples else None
    return train, val


class ConvBase(nn.Module):
    """The MNIST-1D paper's CNN: three stride-2 convolutions and a linear classifier."""

    def __init__(self, width: int = 25) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, width, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.linear = nn.Linear(width * 5, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.linear(x.flatten(1))


def build_model(options: dict[str, Any]) -> nn.Module:
    return ConvBase(width=settings(options).width)


def train_dataset(options: dict[str, Any]) -> TensorDataset:
    return _split(options)[0]


def val_dataset(options: dict[str, Any]) -> TensorDataset | None:
    return _split(options)[1]


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    s = settings(options)
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 1, LENGTH), torch.randint(0, NUM_CLASSES, (batch_size,))
