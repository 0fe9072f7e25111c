"""Vision Transformer image classification: ViT-B/16, ViT-L/16, ViT-H/14, a 6.5 B ViT and a tiny one.

The model is the ViT of Dosovitskiy et al. as torchvision builds it
(``vit_b_16``): a strided convolution cuts the image into patches, a class
token and learned position embeddings are added, pre-norm Transformer encoder
blocks (multi-head self-attention, GELU MLP) follow, and a linear head reads
the class token. The attention's q, k and v are three linear layers where
torchvision packs them into one (the same parameters, so the same counts).

========  =====  =====  ======  =====  =====  =====  =============
variant   image  patch  blocks  width  heads  MLP    parameters
========  =====  =====  ======  =====  =====  =====  =============
vit_b16     224     16      12    768     12   3072     86,567,656
large       224     16      24   1024     16   4096    304,326,632
huge        224     14      32   1280     16   5120    632,045,800
colossal    224     16      32   4096     64  16384  6,452,220,904
tiny         32      4       4     64      4    128        142,026
========  =====  =====  ======  =====  =====  =====  =============

With 1000 classes (tiny: 10). ``vit_b16``, ``large`` and ``huge`` are ViT-B/16,
ViT-L/16 and ViT-H/14, the counts torchvision's ``vit_b_16``, ``vit_l_16`` and
``vit_h_14``; ``colossal`` is the Colossal-AI ViT example's hidden size 4096 x
depth 32 (heads of width 64, MLP 4x the width, 16x16 patches: our choice where
the example's size names only width and depth). The tiny variant is the one CPU
tests and profilers use.

Hybrid layouts (docs/hybrid.md): the blocks are :func:`blocks`; each block's
tensor-parallel plan is :func:`tp_plan` (heads and MLP units split across the
TP group, Megatron-style); a pipeline stage is :func:`pipeline_stage`.

The seed's ViT example trained a ViT on ImageNet with the T2T-ViT code base;
this workload is the plain ViT, written in PyTorch with no timm or torchvision.
The training recipe is kept simple: AdamW with decoupled weight decay (none on
norms, biases), optional linear warm-up, plain cross-entropy (no mixup or
label smoothing).

Data: the same as the ``resnet`` workload: an ImageFolder tree
``<data>/train/<class>/<image>`` (and ``val/``) when ``[job] data`` is set,
undecodable images skipped and counted (``dataset.skipped``); else generated
class-conditional images.

Seed settings (``jabas_config_example_vit.json`` and the seed's ViT README):
global batch size 512 to 32,768, similarity target 0.3, local batch size 32
(the seed's worker example: one VSW per GPU, two extra accumulation steps on
the faster V100s). ``examples/vit.toml`` holds them. The seed's recipe (AdamW,
learning rate 5e-4, weight decay 0.05) is the default here.

Options (``[job] options``), with their defaults for ``vit_b16`` (and ``large``, ``huge``, ``colossal``) /
``tiny``:

- ``num_classes`` (1000 / 10): with data, the number of class folders.
- ``image_size`` (224 / 32): the image side, a multiple of the patch size.
- ``dropout`` (0.0): dropout after attention and in the MLP.
- ``lr`` (5e-4 / 1e-3), ``weight_decay`` (0.05): AdamW, the learning rate at
  the initial global batch size; no weight decay on norms and biases.
- ``warmup_iters`` (10,000 / 0): linear learning-rate warm-up iterations.
- ``synthetic_size`` (1,281,167 / 2,048): training images without data.
- ``verify_images`` (false): decode every image before training.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jabascli.builtin_models import _images
from jabascli.builtin_models._classify import count_correct as count_correct
from jabascli.builtin_models._classify import loss as loss
from jabascli.builtin_models._optim import adamw, warmup
from jabascli.builtin_models._options import Spec, resolve
from jabascli.errors import InputError

NAME = "vit"

SPECS = _images.classifier_specs(
    image_size=Spec(int, "image side; a multiple of the patch size", minimum=1),
    dropout=Spec(float, "dropout after attention and in the MLP", minimum=0),
    lr=Spec(float, "AdamW learning rate", minimum=0),
    weight_decay=Spec(float, "AdamW weight decay (not on norms and biases)", minimum=0),
)
VARIANTS: dict[str, dict[str, Any]] = {
    "vit_b16": {
        "num_classes": None,
        "image_size": 224,
        "dropout": 0.0,
        "lr": 5e-4,
        "weight_decay": 0.05,
        "warmup_iters": 10_000,
        "synthetic_size": 1_281_167,
        "verify_images": False,
    },
    "tiny": {
        "num_classes": None,
        "image_size": 32,
        "dropout": 0.0,
        "lr": 1e-3,
        "weight_decay": 0.05,
        "warmup_iters": 0,
        "synthetic_size": 2048,
        "verify_images": False,
    },
}
# The seeds' larger sizes train as ViT-B/16 does (ImageNet's 224 x 224 images, the same recipe).
VARIANTS |= {name: dict(VARIANTS["vit_b16"]) for name in ("large", "huge", "colossal")}
# patch, layers, width, heads, MLP width
ARCHITECTURES = {
    "vit_b16": (16, 12, 768, 12, 3072),
    "large": (16, 24, 1024, 16, 4096),
    "huge": (14, 32, 1280, 16, 5120),
    "colossal": (16, 32, 4096, 64, 16384),
    "tiny": (4, 4, 64, 4, 128),
}
DEFAULT_CLASSES = {"vit_b16": 1000, "large": 1000, "huge": 1000, "colossal": 1000, "tiny": 10}
SYNTHETIC_VAL_SIZE = {"vit_b16": 50_000, "large": 50_000, "huge": 50_000, "colossal": 50_000, "tiny": 512}


def settings(options: dict[str, Any]) -> Any:
    s = resolve(options, SPECS, VARIANTS, "vit_b16")
    patch = ARCHITECTURES[s.variant][0]
    if s.image_size % patch:
        raise InputError.at(
            None, "job.options.image_size", f"{s.image_size} is not a multiple of the patch size {patch}"
        )
    return s


class SelfAttention(nn.Module):
    """Multi-head self-attention with q, k and v as three linear layers (``nn.MultiheadAttention`` packs them into
    one weight, which a column split would cut across q, k and v). Heads are counted from the projection's
    width, so a tensor-parallel rank holding a column slice of ``q``/``k``/``v`` runs its share of the heads.

    Initialised as ``nn.MultiheadAttention``: the q, k, v weights uniform in +-sqrt(6 / (width + 3 x width))
    (Xavier over the packed 3 x width rows), their biases and the output's bias zero."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        bound = math.sqrt(6 / (4 * width))
        for layer in (self.q, self.k, self.v):
            nn.init.uniform_(layer.weight, -bound, bound)
            nn.init.zeros_(layer.bias)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, -1, self.head_width).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class EncoderBlock(nn.Module):
    """Pre-norm Transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, width: int, heads: int, mlp_width: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-6)
        self.self_attention = SelfAttention(width, heads)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_width, width),
            nn.Dropout(dropout),
        )
        for layer in (self.mlp[0], self.mlp[3]):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.normal_(layer.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int,
        patch_size: int,
        layers: int,
        width: int,
        heads: int,
        mlp_width: int,
        num_classes: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.conv_proj = nn.Conv2d(3, width, patch_size, stride=patch_size)
        tokens = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, width).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        # A dict keyed "0", "1" ... (the same parameter names as a list): a pipeline stage deletes the
        # blocks it does not hold and keeps the names of the rest.
        self.blocks = nn.ModuleDict({str(i): EncoderBlock(width, heads, mlp_width, dropout) for i in range(layers)})
        self.ln = nn.LayerNorm(width, eps=1e-6)
        self.head = nn.Linear(width, num_classes)
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images to logits; a pipeline stage (:func:`pipeline_stage`) takes or gives hidden states instead."""
        if self.conv_proj is not None:
            x = self._embed(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.ln(x[:, 0]))

    def _embed(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images).flatten(2).transpose(1, 2)  # (batch, patches, width)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        if x.shape[1] != self.pos_embedding.shape[1]:
            raise ValueError(
                f"images of {images.shape[-2]}x{images.shape[-1]} give {x.shape[1] - 1} patches; "
                f"the model was built for {self.pos_embedding.shape[1] - 1}"
            )
        return self.dropout(x + self.pos_embedding)


def num_classes(s: Any) -> int:
    return _images.num_classes(s.data, s.num_classes, DEFAULT_CLASSES[s.variant])


def build_model(options: dict[str, Any]) -> nn.Module:
    s = settings(options)
    patch, layers, width, heads, mlp_width = ARCHITECTURES[s.variant]
    return VisionTransformer(s.image_size, patch, layers, width, heads, mlp_width, num_classes(s), s.dropout)


def blocks(model: VisionTransformer) -> list[nn.Module]:
    """The encoder blocks, in order: the units of sharding, checkpointing and pipeline stages (docs/hybrid.md)."""
    return list(model.blocks.values())


def pipeline_stage(model: VisionTransformer, first: int, last: int) -> nn.Module:
    """``model`` cut, in place, to blocks ``first..last``: with the patch and position embeddings and the class
    token only if ``first`` is block 0, with the final norm and head only if ``last`` is the last block.
    Parameter names do not change (DCP checkpoints rely on them)."""
    count = len(model.blocks)
    for key in [k for k in model.blocks if not first <= int(k) <= last]:
        del model.blocks[key]
    if first > 0:
        model.conv_proj = model.class_token = model.pos_embedding = None  # type: ignore[assignment]
    if last < count - 1:
        model.ln = model.head = None  # type: ignore[assignment]
    return model


def tp_plan(block: EncoderBlock) -> dict[str, Any]:
    """How one block splits across a tensor-parallel group: heads and MLP units column-wise in, row-wise out,
    so a block needs one all-reduce in forward after attention and one after the MLP (Megatron-LM).
    The group's size must divide the heads and the MLP width."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    column, row = ColwiseParallel(), RowwiseParallel()
    attention = {f"self_attention.{name}": column for name in ("q", "k", "v")} | {"self_attention.out": row}
    return attention | {"mlp.0": column, "mlp.3": row}


def train_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset:
    s = settings(options)
    return _images.train_split(s, num_classes(s))


def val_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset | None:
    """The val/ split; None (no validation) when the data has no val/ folder."""
    s = settings(options)
    return _images.val_split(s, num_classes(s), SYNTHETIC_VAL_SIZE[s.variant])


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    s = settings(options)
    return adamw(params, s.lr, s.weight_decay)


def lr_scheduler(opt: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    return warmup(opt, settings(options).warmup_iters)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    s = settings(options)
    return _images.random_batch(batch_size, s.image_size, num_classes(s))
