"""Loss and accuracy of the built-in classifiers (digits, MNIST-1D, ResNet, ViT): plain cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the logits ``output`` (batch, classes) against the class indices ``target``."""
    return F.cross_entropy(output, target)


def count_correct(output: torch.Tensor, target: torch.Tensor) -> int:
    """How many samples' highest logit is their class."""
    return int((output.argmax(dim=1) == target).sum())
