"""What a trainer relies on, for every built-in workload: picklable data, copyable models, DDP-ready gradients."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from jabascli.workload import load_workload
from tests.models_support import make_coco, make_image_folder, make_parallel_corpus


def make_token_file(folder: Path) -> Path:
    folder.mkdir(parents=True)
    np.save(folder / "tokens.npy", np.arange(500, dtype=np.int32) % 64)
    return folder / "tokens.npy"


WORKLOADS = ["resnet", "vit", "gnmt", "faster_rcnn", "gpt"]
MAKE_DATA = {
    "resnet": make_image_folder,
    "vit": make_image_folder,
    "gnmt": make_parallel_corpus,
    "faster_rcnn": make_coco,
    "gpt": make_token_file,
}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("name", WORKLOADS)
def test_datasets_and_collate_survive_pickling(name: str, tmp_path: Path) -> None:
    """DataLoader workers started with spawn or forkserver receive the dataset and collate by pickle."""
    w = load_workload(name, {"variant": "tiny"}, data=MAKE_DATA[name](tmp_path / "data"))
    for dataset in (w.train_dataset(), load_workload(name, {"variant": "tiny"}).train_dataset()):
        copy_ = pickle.loads(pickle.dumps(dataset))
        assert len(copy_) == len(dataset)
        torch.manual_seed(0)
        first = copy_[1]
        torch.manual_seed(0)
        again = dataset[1]
        for a, b in zip(first, again, strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if w.collate is not None:
        assert pickle.loads(pickle.dumps(w.collate)) is w.collate


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_parameter_gets_a_gradient_and_copies_agree(name: str) -> None:
    """DDP (without find_unused_parameters) needs a gradient for every parameter; VSW replicas are copies."""
    w = load_workload(name, {"variant": "tiny"})
    torch.manual_seed(0)
    model = w.build_model()
    inputs, target = w.synthetic_batch(2)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    w.loss(model(*inputs), target).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing

    replica = copy.deepcopy(model).eval()
    model.eval()
    restored = w.build_model().eval()
    restored.load_state_dict(model.state_dict())
    torch.manual_seed(1)  # detection samples anchors and proposals at random
    expected = model(*inputs)
    for other in (replica, restored):
        torch.manual_seed(1)
        assert torch.allclose(other(*inputs), expected, atol=1e-6)


def test_images_of_every_mode_decode_to_rgb(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=1, val_per_class=0)
    rgb = np.full((20, 24, 3), 120, dtype=np.uint8)
    folder = root / "train" / "cat"
    Image.fromarray(rgb[:, :, 0], mode="L").save(folder / "grey.jpg")
    Image.fromarray(rgb).convert("CMYK").save(folder / "cmyk.jpg")
    Image.fromarray(rgb).convert("P").save(folder / "palette.png", transparency=0)
    Image.fromarray(np.dstack([rgb, rgb[:, :, :1]])).save(folder / "alpha.PNG")
    Image.fromarray(rgb[:, :, 0].astype(np.int32) * 200, mode="I").save(folder / "sixteen.tif")
    dataset = load_workload("resnet", {"variant": "tiny"}, data=root).train_dataset()
    samples = [dataset[i] for i in range(len(dataset))]
    assert len(samples) == 8 and not dataset.skipped
    assert all(x.shape == (3, 32, 32) and torch.isfinite(x).all() for x, _ in samples)
