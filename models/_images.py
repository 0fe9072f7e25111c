"""Images for the built-in workloads: decoding, an ImageFolder dataset, synthetic images.

Decoding uses Pillow; transforms are written here in plain PyTorch/Pillow (no
torchvision). Values are normalised with the ImageNet mean and standard
deviation.

**Bad images.** A file that Pillow cannot decode (not an image, truncated,
zero bytes, a decompression bomb) never stops training. When a sample's image
fails to decode, the dataset records the file in :attr:`ImageDataset.skipped`
and returns the next decodable sample instead, so every batch keeps its size
(IIDP needs every local batch to hold exactly LBS samples).
:meth:`ImageDataset.summary` says how many were skipped and which.
:meth:`ImageDataset.verify` (or the workloads' ``verify_images = true`` option)
decodes every image up front and drops the bad ones before training, which is
the way to get a complete count: with DataLoader worker processes, images found
bad during training are recorded in the worker's copy of the dataset.

**Wrong layout.** A data folder that is not an ImageFolder tree raises
:class:`~jabascli.errors.InputError` naming the folder and saying what was
expected.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from jabascli.builtin_models._options import Spec
from jabascli.errors import InputError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
LAYOUT = "an ImageFolder tree: <data>/train/<class>/<image> (and optionally <data>/val/<class>/<image>)"
# Resize the shorter side to size / CENTER_CROP_FRACTION before the centre crop (256 for 224).
CENTER_CROP_FRACTION = 0.875


class BadImage(Exception):
    """An image file that could not be decoded; the message says why."""


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def open_rgb(path: Path, draft_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode an image file into an RGB Pillow image, or raise :class:`BadImage`.

    ``draft_size`` lets the JPEG decoder skip detail that a later downscale to
    at least that size would discard.
    """
    try:
        with Image.open(path) as image:
            if draft_size is not None and image.format == "JPEG":
                image.draft("RGB", draft_size)
            return image.convert("RGB")  # forces the full decode
    except FileNotFoundError:
        raise BadImage("file not found") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadImage(str(exc) or type(exc).__name__) from None


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as a normalised float tensor of shape (3, H, W)."""
    array = (np.asarray(image, dtype=np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def random_resized_crop(
    image: Image.Image,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Image.Image:
    """A random crop of random area and aspect ratio, resized to size x size.

    The sampling follows the standard Inception-style recipe (torchvision's
    ``RandomResizedCrop``): ten tries at a crop inside the image, then a
    centred crop of the nearest allowed aspect ratio. Randomness comes from
    torch, so DataLoader workers get distinct, seeded streams.
    """
    width, height = image.size
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * (scale[0] + (scale[1] - scale[0]) * torch.rand(()).item())
        aspect = math.exp(log_lo + (log_hi - log_lo) * torch.rand(()).item())
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, ()).item())
            top = int(torch.randint(0, height - h + 1, ()).item())
            return image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))


def resize_center_crop(image: Image.Image, size: int) -> Image.Image:
    """Resize the shorter side to ``size / 0.875``, then take the centred size x size crop."""
    width, height = image.size
    short = round(size / CENTER_CROP_FRACTION)
    if width <= height:
        new_w, new_h = short, max(short, round(height * short / width))
    else:
        new_w, new_h = max(short, round(width * short / height)), short
    image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return image.crop((left, top, left + size, top + size))


def hflip(image: Image.Image) -> Image.Image:
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


class ImageDataset(Dataset):
    """Base of the image datasets: decoding with skip-and-substitute for bad files.

    Subclasses set :attr:`paths` (one image per sample) and implement
    :meth:`_sample`, which turns a decoded image and the sample index into the
    sample.
    """

    paths: list[Path]
    root: Path

    def __init__(self) -> None:
        self.skipped: dict[Path, str] = {}
        """Images that could not be decoded, each with the reason, in the order found."""

    def __len__(self) -> int:
        return len(self.paths)

    def _decode(self, index: int) -> Image.Image:
        return open_rgb(self.paths[index])

    def _sample(self, image: Image.Image, index: int):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        n = len(self.paths)
        for attempt in range(n):
            i = (index + attempt) % n
            if self.paths[i] in self.skipped:
                continue
            try:
                image = self._decode(i)
            except BadImage as exc:
                self.skipped[self.paths[i]] = str(exc)
                continue
            return self._sample(image, i)
        raise InputError.at(self.root, None, f"none of the {n} images could be decoded ({self.summary()})")

    def verify(self) -> None:
        """Decode every image now and drop the ones that fail (recorded in :attr:`skipped`)."""
        good = []
        for i, path in enumerate(self.paths):
            try:
                self._decode(i)
            except BadImage as exc:
                self.skipped[path] = str(exc)
            else:
                good.append(i)
        if not good:
            raise InputError.at(self.root, None, f"none of the {len(self.paths)} images could be decoded")
        self._keep(good)

    def _keep(self, indices: Sequence[int]) -> None:
        """Keep only these samples (subclasses with per-sample data extend this)."""
        self.paths = [self.paths[i] for i in indices]

    def summary(self, limit: int = 5) -> str:
        """One line: how many images were skipped and the first few, with reasons."""
        if not self.skipped:
            return f"all images decoded so far ({len(self.paths)} samples)"
        items = list(self.skipped.items())
        shown = "; ".join(f"{p} ({why})" for p, why in items[:limit])
        more = f"; and {len(items) - limit} more" if len(items) > limit else ""
        return f"{len(items)} image(s) could not be decoded and were skipped: {shown}{more}"


class ImageFolder(ImageDataset):
    """Classification images in one folder per class: ``<root>/<split>/<class>/<image>``.

    Classes are the sorted sub-folder names of the *train* split, so train and
    val share one label numbering; a val class that train lacks is an error.
    Files whose extension is not an image's, and hidden files, are ignored.
    Training samples get a random resized crop and a horizontal flip;
    validation samples a resize and centre crop.
    """

    def __init__(
        self, root: Path, split: str, image_size: int, train: bool, classes: Sequence[str] | None = None
    ) -> None:
        super().__init__()
        self.root = Path(root) / split
        self.image_size = image_size
        self.train = train
        found = scan_classes(self.root)
        self.classes = list(classes) if classes is not None else list(found)
        index = {name: i for i, name in enumerate(self.classes)}
        unknown = [name for name in found if name not in index]
        if unknown:
            raise InputError.at(
                self.root / unknown[0], None, f"class folder not present in train/ ({len(unknown)} such: {unknown[:5]})"
            )
        self.paths, self.labels = [], []
        for name, files in found.items():
            self.paths += files
            self.labels += [index[name]] * len(files)

    def _keep(self, indices: Sequence[int]) -> None:
        super()._keep(indices)
        self.labels = [self.labels[i] for i in indices]

    def _decode(self, index: int) -> Image.Image:
        if self.train:
            return open_rgb(self.paths[index])
        short = round(self.image_size / CENTER_CROP_FRACTION)
        return open_rgb(self.paths[index], draft_size=(short, short))

    def _sample(self, image: Image.Image, index: int) -> tuple[torch.Tensor, int]:
        if self.train:
            image = random_resized_crop(image, self.image_size)
            if torch.rand(()).item() < 0.5:
                image = hflip(image)
        else:
            image = resize_center_crop(image, self.image_size)
        return to_tensor(image), self.labels[index]


def check_root(root: Path) -> Path:
    root = Path(root)
    if not root.exists():
        raise InputError.at(root, None, f"data folder not found; expected {LAYOUT}")
    if not root.is_dir():
        raise InputError.at(root, None, f"is a file; expected a folder holding {LAYOUT}")
    return root


def scan_classes(split_dir: Path) -> dict[str, list[Path]]:
    """Class name -> sorted image files of one split folder, checking the layout."""
    entries = sorted(os.scandir(split_dir), key=lambda e: e.name)
    loose = [e.name for e in entries if e.is_file() and is_image(e.name)]
    if loose:
        raise InputError.at(
            split_dir,
            None,
            f"holds {len(loose)} image(s) directly (e.g. {loose[0]}); "
            f"images must sit in one sub-folder per class: {split_dir.name}/<class>/<image>",
        )
    classes: dict[str, list[Path]] = {}
    for entry in entries:
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        files = sorted(Path(entry.path, f.name) for f in os.scandir(entry.path) if f.is_file() and is_image(f.name))
        if not files:
            raise InputError.at(
                entry.path, None, f"class folder holds no images (looked for {', '.join(IMAGE_EXTENSIONS)})"
            )
        classes[entry.name] = files
    if not classes:
        raise InputError.at(split_dir, None, f"has no class sub-folders; expected {LAYOUT}")
    return classes


def train_split_dir(root: Path) -> Path:
    """``<root>/train``, or an error explaining the expected layout."""
    root = check_root(root)
    train = root / "train"
    if train.is_dir():
        return train
    hint = ""
    subdirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if any(is_image(f.name) for d in subdirs[:20] for f in d.iterdir()):
        hint = " (its sub-folders hold images: is it a split folder? point [job] data at the folder above it)"
    raise InputError.at(root, None, f"no train/ folder; expected {LAYOUT}{hint}")


@contextmanager
def _readable_folders() -> Iterator[None]:
    """Turn an unreadable folder (permissions, I/O) into an InputError naming it."""
    try:
        yield
    except OSError as exc:
        raise InputError.at(exc.filename, None, f"cannot read: {exc.strerror or exc}") from None


def class_names(root: Path) -> list[str]:
    """The class names of an ImageFolder tree (sorted sub-folders of train/), cheaply."""
    with _readable_folders():
        train = train_split_dir(root)
        names = sorted(p.name for p in train.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise InputError.at(train, None, f"has no class sub-folders; expected {LAYOUT}")
    return names


def num_classes(root: Path | None, given: int | None, default: int) -> int:
    """The class count: the data's class folders, else ``given``, else ``default``.

    When both the data and ``given`` are there they must agree.
    """
    if root is None:
        return given or default
    found = len(class_names(root))
    if given is not None and given != found:
        raise InputError.at(
            Path(root) / "train",
            None,
            f"has {found} class folders but [job] options num_classes is {given}; remove the option or fix it",
        )
    return found


def image_folder(root: Path, split: str, image_size: int, verify: bool = False) -> ImageFolder | None:
    """The ``train`` or ``val`` split of an ImageFolder tree; None when there is no val/ folder."""
    with _readable_folders():
        train_split_dir(root)
        if split != "train" and not (Path(root) / split).is_dir():
            return None
        classes = None if split == "train" else class_names(root)
        dataset = ImageFolder(Path(root), split, image_size, train=split == "train", classes=classes)
    if verify:
        dataset.verify()
    return dataset


class SyntheticImages(Dataset):
    """Generated, learnable classification images, the same for every run with the same seed.

    Each class has a fixed low-resolution colour pattern; a sample is its
    class's pattern, upsampled, plus Gaussian noise. Nothing is stored: sample
    ``i`` is regenerated from ``(seed, i)`` each time.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0) -> None:
        self.size, self.num_classes, self.image_size, self.seed = size, num_classes, image_size, seed
        self.skipped: dict[Path, str] = {}

    def __len__(self) -> int:
        return self.size

    def _pattern(self, label: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + label)
        low = torch.randn(1, 3, 4, 4, generator=g)
        return torch.nn.functional.interpolate(low, size=self.image_size, mode="bilinear", align_corners=False)[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(7_919 * (self.seed + 1) + index)
        label = int(torch.randint(0, self.num_classes, (), generator=g))
        noise = torch.randn(3, self.image_size, self.image_size, generator=g)
        return self._pattern(label) + 0.5 * noise, label

    def summary(self) -> str:
        return f"synthetic data ({self.size} samples)"


# What the image classifiers (ResNet, ViT) share ------------------------------------------------------------


def classifier_specs(**own: Spec) -> dict[str, Spec]:
    """An image classifier's options: ``num_classes``, the model's ``own``, then warm-up, synthetic data and
    image verification."""
    return {
        "num_classes": Spec(int, "classes (default: from the data when given)", minimum=2, optional=True),
        **own,
        "warmup_iters": Spec(int, "linear learning-rate warm-up iterations", minimum=0),
        "synthetic_size": Spec(int, "training samples when no data is given", minimum=1),
        "verify_images": Spec(bool, "decode every image before training"),
    }


def train_split(s: Any, classes: int) -> Dataset:
    """The training images of a classifier's settings ``s``: the data's train/ folder, else synthetic ones."""
    if s.data is None:
        return SyntheticImages(s.synthetic_size, classes, s.image_size, seed=0)
    dataset = image_folder(s.data, "train", s.image_size, verify=s.verify_images)
    assert dataset is not None
    return dataset


def val_split(s: Any, classes: int, synthetic_size: int) -> Dataset | None:
    """The val/ split; None (no validation) when the data has no val/ folder."""
    if s.data is None:
        return SyntheticImages(synthetic_size, classes, s.image_size, seed=1)
    return image_folder(s.data, "val", s.image_size, verify=s.verify_images)


def random_batch(batch_size: int, image_size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels: a classifier's synthetic batch."""
    images = torch.randn(batch_size, 3, image_size, image_size)
    return images, torch.randint(0, classes, (batch_size,))
