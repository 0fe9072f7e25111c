"""The resnet workload and the ImageFolder format it shares with vit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jabascli.errors import InputError
from jabascli.workload import builtin_workloads, load_workload
from tests.models_support import make_image_folder, mean, train_losses


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def parameters(workload: str, **options: object) -> int:
    """Parameter count of a workload's model, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = load_workload(workload, options).build_model()
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_torchvision() -> None:
    assert parameters("resnet") == 25_557_032  # resnet50 is the default
    assert parameters("resnet", variant="resnet50") * 4 / 2**20 == pytest.approx(97.49, abs=0.01)  # MiB of float32
    assert parameters("resnet", variant="resnet18") == 11_689_512
    assert parameters("resnet", variant="tiny") == 308_826


def test_resnet50_gradient_buckets_match_the_seed_profile(reference_dir: Path) -> None:
    """DDP's bucketing of ResNet-50's gradients (1 MiB first cap, then 25 MiB) gives the seed's five buckets."""
    assign = getattr(torch.distributed, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        pytest.skip("this PyTorch does not expose DDP's bucket assignment")
    with torch.device("meta"):
        model = load_workload("resnet", {}).build_model()
    ready_order = list(model.parameters())[::-1]  # DDP's initial guess at gradient-ready order
    buckets = assign(ready_order, [2**20, 25 * 2**20])[0]
    sizes = [sum(ready_order[i].numel() * 4 for i in bucket) / 2**20 for bucket in buckets]
    seed = json.loads((reference_dir / "bucket_profile_data" / "resnet50_bucket_size_profile.json").read_text())
    assert sizes == pytest.approx(seed["bucket_size_distribution"], abs=0.1)
    assert sum(sizes) == pytest.approx(97.49, abs=0.01)


def test_builtin_helpers_are_not_workloads() -> None:
    names = set(builtin_workloads())
    assert {"resnet", "vit", "gnmt", "faster_rcnn"} <= names
    assert not any(name.startswith("_") for name in names)


def test_synthetic_data_and_batch_shapes() -> None:
    w = load_workload("resnet", {"variant": "tiny"})
    train, val = w.train_dataset(), w.val_dataset()
    assert len(train) == 2048 and len(val) == 512
    x, y = train[3]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert torch.equal(train[3][0], x)  # regenerated identically
    inputs, target = w.synthetic_batch(5)
    out = w.build_model()(inputs)
    assert out.shape == (5, 10) and w.loss(out, target).ndim == 0
    assert 0 <= w.count_correct(out, target) <= 5


def test_image_folder_is_read_with_labels_from_train(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", classes=("cat", "dog", "eel"), per_class=4, val_per_class=2)
    w = load_workload("resnet", {"variant": "tiny"}, data=root)
    train, val = w.train_dataset(), w.val_dataset()
    assert train.classes == val.classes == ["cat", "dog", "eel"]
    assert len(train) == 12 and len(val) == 6
    x, y = train[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 1
    assert val[0][0].shape == (3, 32, 32)
    assert w.build_model().fc.out_features == 3  # the class count comes from the data
    assert w.synthetic_batch(4)[1].max() < 3
    assert train.summary().startswith("all images decoded")


def test_missing_val_folder_means_no_validation(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=2, val_per_class=0)
    assert not (root / "val").exists()
    assert load_workload("resnet", {"variant": "tiny"}, data=root).val_dataset() is None


def test_tiny_resnet_learns_image_folder(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=8)
    w = load_workload("resnet", {"variant": "tiny", "lr": 0.05}, data=root)
    losses = train_losses(w, w.train_dataset(), batch_size=8, steps=24)
    assert mean(losses[-4:]) < 0.6 * mean(losses[:4]), losses


def test_undecodable_images_are_skipped_and_counted(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=3)
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"not a jpeg at all")
    (root / "train" / "dog" / "empty.png").write_bytes(b"")
    good = (root / "train" / "eel" / "0.jpg").read_bytes()
    (root / "train" / "eel" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (root / "train" / "eel" / "notes.txt").write_text("ignored: not an image extension")

    w = load_workload("resnet", {"variant": "tiny"}, data=root)
    lazy = w.train_dataset()
    assert len(lazy) == 12  # 9 good + 3 bad image files; the .txt file is not a sample
    samples = [lazy[i] for i in range(len(lazy))]  # never raises: a bad image is replaced by the next good one
    assert all(x.shape == (3, 32, 32) for x, _ in samples)
    assert {p.name for p in lazy.skipped} == {"broken.jpg", "empty.png", "truncated.jpg"}
    assert "3 image(s) could not be decoded" in lazy.summary() and "broken.jpg" in lazy.summary()

    verified = load_workload("resnet", {"variant": "tiny", "verify_images": True}, data=root).train_dataset()
    assert len(verified) == 9 and len(verified.skipped) == 3
    assert sorted(set(verified.labels)) == [0, 1, 2]


def test_wrong_layouts_name_the_folder(tmp_path: Path) -> None:
    def error(root: Path) -> str:
        with pytest.raises(InputError) as info:
            load_workload("resnet", {"variant": "tiny"}, data=root).train_dataset()
        return info.value.lines()[0]

    assert "data folder not found" in error(tmp_path / "nowhere")
    (tmp_path / "file.jpg").write_bytes(b"x")
    assert "is a file" in error(tmp_path / "file.jpg")

    split_only = make_image_folder(tmp_path / "a", per_class=1, val_per_class=0) / "train"
    message = error(split_only)
    assert str(split_only) in message and "no train/ folder" in message and "folder above" in message

    flat = tmp_path / "flat"
    make_image_folder(flat, per_class=1)
    (flat / "train" / "stray.jpg").write_bytes((flat / "train" / "cat" / "0.jpg").read_bytes())
    assert "stray.jpg" in error(flat) and "one sub-folder per class" in error(flat)

    empty_class = make_image_folder(tmp_path / "b", per_class=1)
    (empty_class / "train" / "zzz").mkdir()
    assert str(empty_class / "train" / "zzz") in error(empty_class) and "no images" in error(empty_class)

    no_classes = tmp_path / "c"
    (no_classes / "train").mkdir(parents=True)
    assert "no class sub-folders" in error(no_classes)

    extra_val = make_image_folder(tmp_path / "d", per_class=1)
    make_image_folder(tmp_path / "d2", classes=("yak",), per_class=1)
    (tmp_path / "d2" / "val" / "yak").rename(extra_val / "val" / "yak")
    with pytest.raises(InputError, match="not present in train"):
        load_workload("resnet", {"variant": "tiny"}, data=extra_val).val_dataset()


def test_options_are_checked() -> None:
    with pytest.raises(InputError) as info:
        load_workload("resnet", {"varient": "tiny", "lr": "fast", "image_size": 0}).build_model()
    lines = info.value.lines()
    assert any("job.options.varient: unknown option" in line for line in lines)
    assert any("job.options.lr: expected a number, got 'fast'" in line for line in lines)
    assert any("job.options.image_size: must be at least 8" in line for line in lines)
    with pytest.raises(InputError, match="unknown variant 'resnet51'"):
        load_workload("resnet", {"variant": "resnet51"}).build_model()


def test_num_classes_option_must_agree_with_data(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "data", per_class=1)
    with pytest.raises(InputError, match=r"has 3 class folders but .* num_classes is 5"):
        load_workload("resnet", {"variant": "tiny", "num_classes": 5}, data=root).build_model()


def test_optimizer_skips_decay_on_norms_and_biases_and_warms_up() -> None:
    w = load_workload("resnet", {"variant": "tiny", "warmup_iters": 4, "lr": 0.2})
    model = w.build_model()
    opt = w.optimizer(model.parameters())
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 5e-4 and plain["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    scheduler = w.lr_scheduler(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    for _ in range(5):
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert load_workload("resnet", {"variant": "tiny"}).lr_scheduler(opt) is None


def test_unreadable_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_image_folder(tmp_path / "data", per_class=1)
    denied = root / "train"

    def scandir(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    workload = load_workload("resnet", {"variant": "tiny"}, data=root)
    monkeypatch.setattr("jabascli.builtin_models._images.os.scandir", scandir)
    with pytest.raises(InputError) as info:
        workload.train_dataset()
    assert info.value.lines() == [f"{denied}: cannot read: Permission denied"]
