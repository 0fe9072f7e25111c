"""Loading a micro-batch: samples by index, the workload's collate, onto the trainer's device.

Loading runs in the trainer process, right after the worker's random seed is
set (see :class:`~jabascli.engine.vsw.WorkerStep`), so random augmentation in
a dataset follows the samples and not the plan.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate


class BatchLoader:
    """``loader(indices) -> (inputs, target)`` on ``device``."""

    def __init__(self, dataset: Any, device: torch.device, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.device = device
        self.collate = collate or default_collate
        self._getitems = getattr(dataset, "__getitems__", None)

    def __call__(self, indices: Sequence[int]) -> tuple[Any, Any]:
        indices = list(indices)
        samples = self._getitems(indices) if self._getitems is not None else [self.dataset[i] for i in indices]
        inputs, target = self.collate(samples)
        return to_device(inputs, self.device), to_device(target, self.device)


def seed_worker(seed: int, device: torch.device) -> None:
    """Seed every generator a micro-step may draw from: torch (CPU and the trainer's GPU), Python, NumPy.

    (``torch.manual_seed`` would do, but it also queues lazy seeding of every
    accelerator type, recording a stack trace each time: ~0.2 ms per call.)
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) moved to ``device``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def batch_len(target: Any) -> int:
    return int(target.shape[0]) if isinstance(target, torch.Tensor) else len(target)
