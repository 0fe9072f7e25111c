"""GPT: a decoder-only Transformer language model (GPT-2's sizes, and a tiny one).

The model is GPT-2's (Radford et al., 2019): token and learned position
embeddings, pre-norm Transformer blocks (causal multi-head self-attention, GELU
MLP of 4x the width), a final LayerNorm and a linear head over the vocabulary
(not tied to the embedding, so that pipeline stages and shards own disjoint
parameters). The loss is the mean next-token cross-entropy.

========  ======  =====  =====  =======  ======  =============
variant   blocks  width  heads  context  vocab   parameters
========  ======  =====  =====  =======  ======  =============
tiny           4     32      4       16      64  55,488
small         12    768     12     1024  50,257  163,037,184
medium        24   1024     16     1024  50,257  406,286,336
large         36   1280     20     1024  50,257  838,359,040
xl            48   1600     25     1024  50,257  1,638,022,400
========  ======  =====  =====  =======  ======  =============

(GPT-2's published counts are smaller by the untied head.)

Data: without ``[job] data``, generated tokens: a seeded random walk over the
vocabulary (each token is the previous one plus a small step), so that there is
something to learn. With ``[job] data``, a tokenised text file: a flat array of
token ids, either a NumPy ``.npy`` file holding a 1-D integer array or a raw
``.bin`` file of little-endian ``uint16`` ids (nanoGPT's ``train.bin``). It is
cut into non-overlapping windows of ``context + 1`` tokens; a sample's input is
a window's first ``context`` tokens and its target the last ``context``. The
last ``val_fraction`` of the windows are the validation set.

Hybrid layouts (docs/hybrid.md): the blocks are :func:`blocks`; each block's
tensor-parallel plan is :func:`tp_plan` (attention heads and the MLP's hidden
units split across the TP group, Megatron-style: column-wise in, row-wise out);
a pipeline stage is :func:`pipeline_stage`.

Options (``[job] options``), with their defaults:

- ``variant`` (``small``): one of the table above.
- ``context`` (the variant's): tokens per sample, at most the variant's.
- ``dropout`` (0.0): dropout after attention and in the MLP.
- ``lr`` (6e-4 / tiny 1e-3), ``weight_decay`` (0.1): AdamW; no decay on norms and biases.
- ``warmup_iters`` (2,000 / tiny 0): linear learning-rate warm-up iterations.
- ``synthetic_size`` (100,000 / tiny 2,048): training samples without data.
- ``val_fraction`` (0.1): the share of a token file's windows kept for validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jabascli.builtin_models._optim import adamw, warmup
from jabascli.builtin_models._options import Spec, resolve
from jabascli.errors import InputError

NAME = "gpt"

# blocks, width, heads, context, vocabulary
ARCHITECTURES = {
    "tiny": (4, 32, 4, 16, 64),
    "small": (12, 768, 12, 1024, 50257),
    "medium": (24, 1024, 16, 1024, 50257),
    "large": (36, 1280, 20, 1024, 50257),
    "xl": (48, 1600, 25, 1024, 50257),
}
SPECS = {
    "context": Spec(int, "tokens per sample, at most the variant's", minimum=1, optional=True),
    "dropout": Spec(float, "dropout after attention and in the MLP", minimum=0),
    "lr": Spec(float, "AdamW learning rate", minimum=0),
    "weight_decay": Spec(float, "AdamW weight decay (not on norms and biases)", minimum=0),
    "warmup_iters": Spec(int, "linear learning-rate warm-up iterations", minimum=0),
    "synthetic_size": Spec(int, "training samples when no data is given", minimum=1),
    "val_fraction": Spec(float, "share of a token file's windows kept for validation", minimum=0),
}
_LARGE = {
    "context": None,
    "dropout": 0.0,
    "lr": 6e-4,
    "weight_decay": 0.1,
    "warmup_iters": 2000,
    "synthetic_size": 100_000,
    "val_fraction": 0.1,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": {**_LARGE, "lr": 1e-3, "warmup_iters": 0, "synthetic_size": 2048},
    **{name: dict(_LARGE) for name in ("small", "medium", "large", "xl")},
}


def settings(options: dict[str, Any]) -> Any:
    s = resolve(options, SPECS, VARIANTS, "small")
    most = ARCHITECTURES[s.variant][3]
    s.context = most if s.context is None else s.context
    if s.context > most:
        raise InputError.at(None, "job.options.context", f"{s.context} is above the variant's {most} positions")
    if s.val_fraction >= 1:
        raise InputError.at(None, "job.options.val_fraction", f"{s.val_fraction} leaves nothing to train on")
    return s


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions. Heads are counted from the projection's width, so a
    tensor-parallel rank holding a column slice of ``q``/``k``/``v`` runs its share of the heads unchanged."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_width = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, -1, self.head_width).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.dropout(self.out(y.transpose(1, 2).reshape(batch, length, -1)))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.dropout(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, blocks: int, width: int, heads: int, context: int, vocabulary: int, dropout: float) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocabulary, width)
        self.position_embedding = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        # A dict keyed "0", "1" ... (the same parameter names as a list): a pipeline stage deletes the
        # blocks it does not hold and keeps the names of the rest.
        self.blocks = nn.ModuleDict({str(i): Block(width, heads, dropout) for i in range(blocks)})
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        for name, p in self.named_parameters():
            if p.ndim > 1:
                # GPT-2's initialisation: N(0, 0.02), residual projections scaled down by sqrt(2 x blocks).
                std = 0.02 / (2 * blocks) ** 0.5 if name.endswith(("out.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; a pipeline stage (:func:`pipeline_stage`) takes or gives hidden states instead."""
        if self.token_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.dropout(self.token_embedding(x) + self.position_embedding(positions))
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.ln_f(x))


def build_model(options: dict[str, Any]) -> nn.Module:
    s = settings(options)
    blocks, width, heads, context, vocabulary = ARCHITECTURES[s.variant]
    return GPT(blocks, width, heads, context, vocabulary, s.dropout)


def blocks(model: GPT) -> list[nn.Module]:
    """The repeated Transformer blocks, in order: the units of sharding, checkpointing and pipeline stages."""
    return list(model.blocks.values())


def pipeline_stage(model: GPT, first: int, last: int) -> nn.Module:
    """``model`` cut, in place, to blocks ``first..last``: with the embeddings only if ``first`` is block 0,
    with the final norm and head only if ``last`` is the last block. Parameter names do not change."""
    count = len(model.blocks)
    for key in [k for k in model.blocks if not first <= int(k) <= last]:
        del model.blocks[key]
    if first > 0:
        model.token_embedding = model.position_embedding = None  # type: ignore[assignment]
    if last < count - 1:
        model.ln_f = model.head = None  # type: ignore[assignment]
    return model


def tp_plan(block: Block) -> dict[str, Any]:
    """How one block splits across a tensor-parallel group: heads and MLP units column-wise in, row-wise out,
    so a block needs one all-reduce in forward after attention and one after the MLP (Megatron-LM)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    column, row = ColwiseParallel(), RowwiseParallel()
    return {"attention.q": column, "attention.k": column, "attention.v": column, "attention.out": row} | {
        "fc": column,
        "proj": row,
    }


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``context + 1`` tokens of a flat token array, from window ``first`` on."""

    def __init__(self, tokens: np.ndarray, context: int, first: int, count: int) -> None:
        self.tokens, self.context, self.first, self.count = tokens, context, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.first + i) * (self.context + 1)
        window = torch.from_numpy(self.tokens[start : start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


def read_tokens(path: Path, vocabulary: int) -> np.ndarray:
    """The token ids of a ``.npy`` (1-D integer array) or ``.bin`` (raw little-endian uint16) file."""
    try:
        tokens = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, dtype="<u2", mode="r")
    except (OSError, ValueError) as exc:
        raise InputError.at(path, None, f"cannot read token ids: {exc}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InputError.at(
            path, None, f"expected a flat array of integer token ids, got {tokens.dtype} {tokens.shape}"
        )
    if tokens.size and (int(tokens.max()) >= vocabulary or int(tokens.min()) < 0):
        raise InputError.at(path, None, f"token ids must lie in [0, {vocabulary}): the vocabulary of the variant")
    return tokens


def generated_tokens(count: int, vocabulary: int, seed: int) -> np.ndarray:
    """A random walk over the vocabulary: each token is the previous one plus -2..2, modulo the vocabulary."""
    steps = np.random.default_rng(seed).integers(-2, 3, size=count)
    return np.cumsum(steps) % vocabulary


def _datasets(options: dict[str, Any]) -> tuple[TokenWindows, TokenWindows]:
    s = settings(options)
    vocabulary, window = ARCHITECTURES[s.variant][4], s.context + 1
    if s.data is None:
        train = generated_tokens(s.synthetic_size * window, vocabulary, seed=0)
        val = generated_tokens(max(s.synthetic_size // 8, 1) * window, vocabulary, seed=1)
        return TokenWindows(train, s.context, 0, s.synthetic_size), TokenWindows(val, s.context, 0, len(val) // window)
    tokens = read_tokens(Path(s.data), vocabulary)
    windows = len(tokens) // window
    held = int(windows * s.val_fraction)
    if windows - held < 1:
        raise InputError.at(s.data, None, f"{len(tokens)} tokens make no training window of {window} tokens")
    return TokenWindows(tokens, s.context, 0, windows - held), TokenWindows(tokens, s.context, windows - held, held)


def train_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset:
    return _datasets(options)[0]


def val_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset | None:
    val = _datasets(options)[1]
    return val if len(val) else None


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    s = settings(options)
    return adamw(params, s.lr, s.weight_decay)


def lr_scheduler(opt: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    return warmup(opt, settings(options).warmup_iters)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    s = settings(options)
    tokens = torch.randint(0, ARCHITECTURES[s.variant][4], (batch_size, s.context + 1))
    return tokens[:, :-1], tokens[:, 1:]
