"""Activation checkpointing of chosen blocks: their activations are recomputed in backward, not kept.

A checkpointed block keeps only its input from forward; backward runs its
forward again (``torch.utils.checkpoint``, non-reentrant, with the RNG state of
the first run restored, so dropout draws the same masks) and then its backward.
The gradient is the same computation on the same values, so training is
unchanged, bit for bit; the cost is one more forward of the block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: Sequence[nn.Module], indices: Sequence[int]) -> None:
    """Make ``blocks[i].forward`` checkpointed for every ``i`` in ``indices``, in place.

    The module tree and its parameter names stay as they are (no wrapper module), so
    state dicts and checkpoints do not change with the layout.
    """
    for i in indices:
        block = blocks[i]
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
