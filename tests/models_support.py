"""Helpers for the built-in workload tests: tiny instances of real data formats, a short training loop."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from jabascli.workload import Workload

# One colour per class; images are that colour plus noise, so a tiny model learns them in a few steps.
COLOURS = [(220, 40, 40), (40, 200, 60), (50, 70, 230), (230, 210, 40), (200, 60, 200)]


def write_jpeg(path: Path, colour: Sequence[int], size: tuple[int, int], seed: int) -> None:
    """A JPEG of ``size`` (width, height): a flat colour with noise."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=90)


def make_image_folder(
    root: Path, classes: Sequence[str] = ("cat", "dog", "eel"), per_class: int = 6, val_per_class: int = 2
) -> Path:
    """An ImageFolder tree root/{train,val}/<class>/<n>.jpg of small, varied-size JPEGs."""
    seed = 0
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c, name in enumerate(classes):
            for i in range(count):
                seed += 1
                size = (40 + 7 * (i % 3), 36 + 5 * (i % 4))
                write_jpeg(root / split / name / f"{i}.jpg", COLOURS[c % len(COLOURS)], size, seed)
    return root


def make_coco(
    root: Path, split: str = "train2017", images: int = 6, size: tuple[int, int] = (96, 80), num_categories: int = 2
) -> Path:
    """A tiny COCO detection set: root/<split>/*.jpg and root/annotations/instances_<split>.json.

    Each image is noise with one or two filled rectangles; a rectangle's colour is its category's.
    Category ids are deliberately not contiguous (COCO's are not).
    """
    rng = np.random.default_rng(0)
    categories = [{"id": 3 * k + 2, "name": f"thing{k}", "supercategory": "thing"} for k in range(num_categories)]
    entries, annotations = [], []
    for n in range(images):
        width, height = size
        pixels = rng.normal(128, 20, (height, width, 3))
        for r in range(1 + n % 2):
            k = (n + r) % num_categories
            w, h = int(rng.integers(20, 40)), int(rng.integers(20, 36))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            pixels[y : y + h, x : x + w] = COLOURS[k]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": 100 + n,
                    "category_id": categories[k]["id"],
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
        name = f"{n:012d}.jpg"
        (root / split).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / split / name, quality=92)
        entries.append({"id": 100 + n, "file_name": name, "width": width, "height": height})
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    document = {"images": entries, "annotations": annotations, "categories": categories}
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(document))
    return root


def make_parallel_corpus(root: Path, pairs: int = 64, prefix: str = "train.tok.clean.bpe.32000") -> Path:
    """A tiny tokenised parallel corpus in the WMT16 en-de layout (plus its vocabulary file).

    The "translation" is learnable: each English word has one German word, and
    the German sentence is the word-for-word translation.
    """
    english = ["the", "cat", "dog", "sat", "on", "mat", "a", "big", "small", "red", "house", "ran"]
    german = ["die", "katze", "hund", "sa@@", "auf", "matte", "ein", "gross", "klein", "rot", "haus", "lief"]
    rng = np.random.default_rng(1)
    src, tgt = [], []
    for _ in range(pairs):
        words = rng.integers(0, len(english), int(rng.integers(3, 9)))
        src.append(" ".join(english[w] for w in words))
        tgt.append(" ".join(german[w] for w in words))
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{prefix}.en").write_text("\n".join(src) + "\n")
    (root / f"{prefix}.de").write_text("\n".join(tgt) + "\n")
    (root / "vocab.bpe.32000").write_text("\n".join(english + german) + "\n")
    return root


def train_losses(
    workload: Workload, dataset: Any, batch_size: int, steps: int, seed: int = 0, shuffle: bool = True
) -> list[float]:
    """Train ``workload``'s model for ``steps`` iterations through the workload interface only.

    Mirrors what a trainer does with one worker: the workload's collate (if
    any), inputs passed as positional arguments when they are a tuple, the
    workload's loss, optimizer and scheduler. Returns the loss of every step.
    """
    torch.manual_seed(seed)
    model = workload.build_model()
    model.train()
    opt = workload.optimizer(model.parameters())
    scheduler = workload.lr_scheduler(opt)
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=workload.collate,
        drop_last=True,
    )
    losses: list[float] = []
    while len(losses) < steps:
        for inputs, target in loader:
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            loss = workload.loss(output, target)
            assert loss.ndim == 0 and torch.isfinite(loss), loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)
