"""Detection data: COCO-format annotations, synthetic boxes, and batching.

**COCO layout.** ``<data>/annotations/instances_train2017.json`` with images in
``<data>/train2017/`` (and the same for ``val2017``), the layout of the COCO
2017 download; the workload's options rename the files and folders. Of the
annotation file, jabas reads ``images`` (``id``, ``file_name``),
``categories`` (``id``) and ``annotations`` (``image_id``, ``category_id``,
``bbox`` as ``[x, y, width, height]`` in pixels, ``iscrowd``). Crowd regions
are ignored and boxes of zero width or height are dropped, as torchvision's
detection reference does. Category ids (COCO's run from 1 to 90 with gaps)
become contiguous labels 1..K in id order; 0 is the background.

**Bad input.** An annotation file that is not JSON, or whose entries lack
fields or point at unknown images or categories, raises
:class:`~jabascli.errors.InputError` naming the file and the entry
(``annotations[12].bbox: ...``). Images listed but missing on disk, and
images that do not decode, are skipped and counted in ``dataset.skipped`` (see
:mod:`jabascli.builtin_models._images`).

**Samples and batches.** A sample is ``(image, boxes, labels)``: the image
resized so its shorter side is ``min_size`` unless that makes the longer one
exceed ``max_size`` (torchvision's rule), normalised, shape (3, h, w); its
boxes (G, 4) as ``(x1, y1, x2, y2)`` in the resized image's pixels; labels
(G,). Training samples are flipped left-right half the time.
:func:`collate_detection` pads a batch into tensors only (see there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from jabascli.builtin_models import _images
from jabascli.errors import InputError, Problem

SIZE_DIVISIBLE = 32
MAX_PROBLEMS = 20


class _Problems:
    """Collects problems of one annotation file, keeping the first MAX_PROBLEMS."""

    def __init__(self, path: Path) -> None:
        self.path, self.items, self.count = path, [], 0

    def add(self, field: str, message: str) -> None:
        self.count += 1
        if len(self.items) < MAX_PROBLEMS:
            self.items.append(Problem(self.path, field, message))

    def raise_any(self) -> None:
        if self.count:
            extra = self.count - len(self.items)
            more = [Problem(self.path, None, f"... and {extra} more problems")] if extra else []
            raise InputError(self.items + more)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_annotations(path: Path) -> dict[str, Any]:
    """Parse and check a COCO instances file.

    Returns ``categories`` (ids in order), ``images`` (list of (id, file name))
    and ``objects`` (image id -> list of (category id, [x, y, w, h])), crowd
    regions left out.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder, expected a COCO annotation file" if path.is_dir() else "annotation file not found"
        raise InputError.at(path, None, what)
    try:
        document = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise InputError.at(path, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise InputError.at(path, None, f"invalid JSON: not UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise InputError.at(path, None, f"cannot read: {exc.strerror or exc}") from None
    problems = _Problems(path)
    if not isinstance(document, dict):
        raise InputError.at(path, None, "expected a JSON object with images, annotations and categories")
    for key in ("images", "annotations", "categories"):
        if not isinstance(document.get(key), list):
            got = "missing" if key not in document else f"a {type(document[key]).__name__}"
            problems.add(key, f"expected a list, got {got}")
    problems.raise_any()

    categories: list[int] = []
    for i, entry in enumerate(document["categories"]):
        if not isinstance(entry, dict) or not _is_int(entry.get("id")):
            problems.add(f"categories[{i}].id", "expected an integer category id")
        elif entry["id"] in categories:
            problems.add(f"categories[{i}].id", f"category id {entry['id']} is used twice")
        else:
            categories.append(entry["id"])
    images: list[tuple[int, str]] = []
    image_ids: set[int] = set()
    for i, entry in enumerate(document["images"]):
        if not isinstance(entry, dict):
            problems.add(f"images[{i}]", "expected an object with id and file_name")
            continue
        image_id, name = entry.get("id"), entry.get("file_name")
        if not _is_int(image_id):
            problems.add(f"images[{i}].id", f"expected an integer image id, got {image_id!r}")
        elif not isinstance(name, str) or not name:
            problems.add(f"images[{i}].file_name", f"expected a file name, got {name!r}")
        elif image_id in image_ids:
            problems.add(f"images[{i}].id", f"image id {image_id} is used twice")
        else:
            image_ids.add(image_id)
            images.append((image_id, name))
    known_categories = set(categories)
    objects: dict[int, list[tuple[int, list[float]]]] = {}
    for i, entry in enumerate(document["annotations"]):
        if not isinstance(entry, dict):
            problems.add(f"annotations[{i}]", "expected an object with image_id, category_id and bbox")
            continue
        image_id, category, bbox = entry.get("image_id"), entry.get("category_id"), entry.get("bbox")
        if not _is_int(image_id) or image_id not in image_ids:
            problems.add(f"annotations[{i}].image_id", f"no image with id {image_id!r}")
        elif not _is_int(category) or category not in known_categories:
            problems.add(f"annotations[{i}].category_id", f"no category with id {category!r}")
        elif not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_number(v) for v in bbox)):
            problems.add(f"annotations[{i}].bbox", f"expected [x, y, width, height] (4 numbers), got {bbox!r}")
        elif bbox[2] < 0 or bbox[3] < 0:
            problems.add(f"annotations[{i}].bbox", f"width and height must not be negative, got {bbox!r}")
        elif not entry.get("iscrowd", 0):
            objects.setdefault(image_id, []).append((category, [float(v) for v in bbox]))
    problems.raise_any()
    return {"categories": categories, "images": images, "objects": objects}


def resize_scale(height: int, width: int, min_size: int, max_size: int) -> float:
    """torchvision's detection resize: shorter side to min_size, unless the longer then exceeds max_size."""
    return min(min_size / min(height, width), max_size / max(height, width))


class CocoDetection(_images.ImageDataset):
    """Images and boxes of a COCO instances file (see the module docstring)."""

    def __init__(self, annotations: Path, image_dir: Path, min_size: int, max_size: int, train: bool) -> None:
        super().__init__()
        self.annotations, self.root = Path(annotations), Path(image_dir)
        self.min_size, self.max_size, self.train = min_size, max_size, train
        parsed = read_annotations(self.annotations)
        if not self.root.is_dir():
            raise InputError.at(self.root, None, f"image folder not found (the images of {self.annotations.name})")
        self.categories: list[int] = parsed["categories"]
        """COCO category ids; label ``k`` (1-based) is ``categories[k - 1]``."""
        label = {category: k + 1 for k, category in enumerate(self.categories)}
        self.paths, self.objects = [], []
        for image_id, name in parsed["images"]:
            path = self.root / name
            if not path.is_file():
                self.skipped[path] = "file not found"
                continue
            found = parsed["objects"].get(image_id, [])
            boxes = np.array([b for _, b in found], dtype=np.float32).reshape(-1, 4)
            boxes[:, 2:] += boxes[:, :2]  # [x, y, w, h] -> [x1, y1, x2, y2]
            self.paths.append(path)
            self.objects.append((boxes, np.array([label[c] for c, _ in found], dtype=np.int64)))
        if not self.paths:
            raise InputError.at(
                self.root, None, f"none of the {len(parsed['images'])} images listed in {self.annotations} is here"
            )

    def _keep(self, indices: Sequence[int]) -> None:
        super()._keep(indices)
        self.objects = [self.objects[i] for i in indices]

    def _sample(self, image: Image.Image, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        boxes, labels = self.objects[index]
        width, height = image.size
        boxes = boxes.copy()
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, width)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, height)
        real = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes, labels = boxes[real], labels[real]
        scale = resize_scale(height, width, self.min_size, self.max_size)
        new_w, new_h = max(1, round(width * scale)), max(1, round(height * scale))
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
        boxes *= np.array([new_w / width, new_h / height] * 2, dtype=np.float32)
        if self.train and torch.rand(()).item() < 0.5:
            image = _images.hflip(image)
            boxes[:, [0, 2]] = new_w - boxes[:, [2, 0]]
        return _images.to_tensor(image), torch.from_numpy(boxes), torch.from_numpy(labels)

    def summary(self, limit: int = 5) -> str:
        return f"{self.annotations.name}: {len(self.paths)} images; " + super().summary(limit)


class SyntheticDetection(Dataset):
    """Generated detection images: one to three filled rectangles, coloured by class, on noise.

    Rectangles span 1/8 to 1/2 of the image side; sample ``i`` is regenerated
    from ``(seed, i)``. Images come at the model's input size, normalised.
    """

    def __init__(self, size: int, num_classes: int, height: int, width: int, seed: int = 0) -> None:
        self.size, self.num_classes, self.height, self.width, self.seed = size, num_classes, height, width, seed
        self.skipped: dict[Path, str] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(15_485_863 * (self.seed + 1) + index)
        image = 0.5 * torch.randn(3, self.height, self.width, generator=g)
        count = int(torch.randint(1, 4, (), generator=g))
        labels = torch.randint(1, self.num_classes, (count,), generator=g)
        boxes = torch.zeros(count, 4)
        side = min(self.height, self.width)
        for n, label in enumerate(labels.tolist()):
            w, h = (int(v) for v in torch.randint(side // 8, side // 2 + 1, (2,), generator=g))
            x = int(torch.randint(0, self.width - w + 1, (), generator=g))
            y = int(torch.randint(0, self.height - h + 1, (), generator=g))
            image[:, y : y + h, x : x + w] = self._colour(label)
            boxes[n] = torch.tensor([x, y, x + w, y + h], dtype=torch.float32)
        return image, boxes, labels

    def _colour(self, label: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + label)
        return (2 * torch.rand(3, generator=g) - 1).mul(2).view(3, 1, 1)

    def summary(self) -> str:
        return f"synthetic data ({self.size} images)"


def collate_detection(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Batch detection samples into tensors: ``((images, image_sizes, boxes, labels), labels)``.

    Images are zero-padded (zero is the mean colour after normalisation) at
    the bottom and right to a common size divisible by 32; ``image_sizes``
    (B, 2) holds each image's own (height, width). Boxes (B, G, 4) and labels
    (B, G) are padded to the largest box count G of the batch with label -1.
    The labels double as the target so the trainer sees one row per image.
    """
    heights = [image.shape[1] for image, _, _ in samples]
    widths = [image.shape[2] for image, _, _ in samples]
    height = math.ceil(max(heights) / SIZE_DIVISIBLE) * SIZE_DIVISIBLE
    width = math.ceil(max(widths) / SIZE_DIVISIBLE) * SIZE_DIVISIBLE
    most = max(len(boxes) for _, boxes, _ in samples)
    images = torch.zeros(len(samples), 3, height, width)
    boxes = torch.zeros(len(samples), most, 4)
    labels = torch.full((len(samples), most), -1, dtype=torch.int64)
    for i, (image, b, lab) in enumerate(samples):
        images[i, :, : image.shape[1], : image.shape[2]] = image
        boxes[i, : len(b)] = b
        labels[i, : len(lab)] = lab
    sizes = torch.tensor([heights, widths], dtype=torch.int64).T.contiguous()
    return (images, sizes, boxes, labels), labels
