"""The vit workload (ImageFolder loading itself is covered in test_models_resnet.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jabascli.errors import InputError
from jabascli.workload import load_workload
from tests.models_support import make_image_folder, mean, train_losses


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def parameters(**options: object) -> int:
    with torch.device("meta"):
        model = load_workload("vit", options).build_model()
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts() -> None:
    assert parameters() == 86_567_656  # ViT-B/16 (the default variant), as torchvision's vit_b_16
    assert parameters(variant="tiny") == 142_026
    # The position embedding follows the image size: 64 extra patches of width 64 at 64x64 with 4x4 patches.
    assert parameters(variant="tiny", image_size=64) == 142_026 + (256 - 64) * 64


def vit_parameters(patch: int, blocks: int, width: int, mlp: int, image: int = 224, classes: int = 1000) -> int:
    """A ViT's count by hand: patch embedding, class token, positions, blocks (2 norms, q/k/v/out, MLP), norm, head."""
    block = 2 * 2 * width + 4 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
    tokens = (image // patch) ** 2 + 1
    return (3 * patch * patch + 1) * width + width + tokens * width + blocks * block + 2 * width + (width + 1) * classes


def test_large_variants_build_without_allocating() -> None:
    assert vit_parameters(16, 12, 768, 3072) == 86_567_656  # the formula holds where torchvision's count is known
    assert parameters(variant="large") == vit_parameters(16, 24, 1024, 4096) == 304_326_632  # torchvision vit_l_16
    assert parameters(variant="huge") == vit_parameters(14, 32, 1280, 5120) == 632_045_800  # torchvision vit_h_14
    assert parameters(variant="colossal") == vit_parameters(16, 32, 4096, 16384) == 6_452_220_904


def test_tiny_vit_learns_image_folder(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=8)
    w = load_workload("vit", {"variant": "tiny"}, data=root)
    train, val = w.train_dataset(), w.val_dataset()
    assert len(train) == 24 and len(val) == 6 and train[0][0].shape == (3, 32, 32)
    losses = train_losses(w, train, batch_size=8, steps=24)
    assert mean(losses[-4:]) < 0.6 * mean(losses[:4]), losses


def test_synthetic_batch_and_accuracy() -> None:
    w = load_workload("vit", {"variant": "tiny"})
    inputs, target = w.synthetic_batch(3)
    out = w.build_model()(inputs)
    assert out.shape == (3, 10) and w.count_correct(out, target) in range(4)
    assert len(w.train_dataset()) == 2048 and len(w.val_dataset()) == 512


def test_image_size_must_fit_the_patches() -> None:
    with pytest.raises(InputError, match="image_size: 30 is not a multiple of the patch size 4"):
        load_workload("vit", {"variant": "tiny", "image_size": 30}).build_model()
    model = load_workload("vit", {"variant": "tiny"}).build_model()
    with pytest.raises(ValueError, match="built for 64"):
        model(torch.randn(1, 3, 48, 48))


def test_adamw_without_decay_on_norms() -> None:
    w = load_workload("vit", {"variant": "tiny", "weight_decay": 0.1})
    opt = w.optimizer(w.build_model().parameters())
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert w.lr_scheduler(opt) is None
    full = load_workload("vit", {})
    assert full.lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)) is not None
