"""A test workload: the built-in tiny GPT or ViT in float64 (or float32), with Adam or SGD + momentum.

Options: ``base`` ("gpt" or "vit"), ``optimizer`` ("adam" or "sgd"), ``float32`` (true: not float64;
the GPT only, as ``collate`` makes images float64), and the base's own options.
"""

from typing import Any

import torch
from torch.utils.data import default_collate

from jabascli.builtin_models import gpt, vit

BASES = {"gpt": gpt, "vit": vit}


def _base(options: dict[str, Any]) -> Any:
    return BASES[options["base"]]


def _own(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in ("base", "optimizer", "float32")}


def build_model(options):
    model = _base(options).build_model(_own(options))
    return model if options.get("float32") else model.double()


def blocks(model):
    return list(model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict) else model.blocks)


def tp_plan(block):
    return (vit if isinstance(block, vit.EncoderBlock) else gpt).tp_plan(block)


def pipeline_stage(model, first, last):
    return (vit if isinstance(model, vit.VisionTransformer) else gpt).pipeline_stage(model, first, last)


def train_dataset(options):
    return _base(options).train_dataset(_own(options))


def val_dataset(options):
    return _base(options).val_dataset(_own(options))


def collate(samples):
    inputs, target = default_collate(samples)
    return (inputs.double() if inputs.is_floating_point() else inputs), target


def loss(output, target):
    return gpt.loss(output, target) if output.ndim == 3 else vit.loss(output, target)


def optimizer(params, options):
    if options["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def synthetic_batch(batch_size, options):
    return _base(options).synthetic_batch(batch_size, _own(options))
