"""Optimizer helpers shared by the built-in workloads."""

from __future__ import annotations

from typing import Any

import torch


def decay_groups(params: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: weights with ``weight_decay``, 1-D tensors (norms, biases) without.

    Parameter groups given already (dicts) are passed through unchanged.
    """
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        return params
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def warmup(optimizer: torch.optim.Optimizer, iterations: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """Linear warm-up over ``iterations`` steps (stepped once per iteration); None when it is 0."""
    if iterations <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / iterations))


def adamw(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on the weights only (:func:`decay_groups`): the transformers' optimizer."""
    return torch.optim.AdamW(decay_groups(params, weight_decay), lr=lr, weight_decay=weight_decay)


def sgd(params: Any, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum and weight decay on the weights only (:func:`decay_groups`): the convolutional nets'."""
    return torch.optim.SGD(decay_groups(params, weight_decay), lr=lr, momentum=momentum, weight_decay=weight_decay)
