"""The faster_rcnn workload, its plain-PyTorch NMS and RoIAlign, and the COCO format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jabascli.builtin_models import _boxes
from jabascli.errors import InputError
from jabascli.workload import load_workload
from tests.models_support import make_coco, mean, train_losses


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def coco(tmp_path: Path) -> Path:
    return make_coco(tmp_path / "coco", images=8)


def tiny(data: Path | None = None, **options: object):  # type: ignore[no-untyped-def]
    return load_workload("faster_rcnn", {"variant": "tiny", **options}, data=data)


def random_boxes(n: int, generator: torch.Generator, size: float = 100.0) -> torch.Tensor:
    corner = torch.rand(n, 2, generator=generator) * size
    extent = 5 + torch.rand(n, 2, generator=generator) * size / 3
    return torch.cat([corner, corner + extent], dim=1)


# -- NMS ------------------------------------------------------------------------------------------


def greedy_nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> list[int]:
    """The textbook loop: take the best remaining box, drop everything overlapping it."""
    remaining = scores.argsort(descending=True).tolist()
    keep = []
    while remaining:
        best = remaining.pop(0)
        keep.append(best)
        iou = _boxes.box_iou(boxes[best : best + 1], boxes[remaining])[0] if remaining else torch.empty(0)
        remaining = [r for r, v in zip(remaining, iou.tolist(), strict=True) if v <= threshold]
    return keep


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_nms_matches_the_greedy_algorithm(threshold: float) -> None:
    g = torch.Generator().manual_seed(int(threshold * 10))
    for n in (1, 2, 30, 300):
        boxes, scores = random_boxes(n, g), torch.rand(n, generator=g)
        assert _boxes.nms(boxes, scores, threshold).tolist() == greedy_nms(boxes, scores, threshold)
    # Long suppression chains: a row of boxes each overlapping the next.
    row = torch.tensor([[10.0 * i, 0, 10.0 * i + 14, 10] for i in range(40)])
    chain_scores = torch.linspace(1, 0, 40)
    assert _boxes.nms(row, chain_scores, threshold).tolist() == greedy_nms(row, chain_scores, threshold)
    assert _boxes.nms(torch.zeros(0, 4), torch.zeros(0), threshold).tolist() == []


def test_batched_nms_keeps_groups_apart() -> None:
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [0, 0, 10, 10]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    assert _boxes.batched_nms(boxes, scores, torch.tensor([0, 0, 1]), 0.5).tolist() == [0, 2]
    assert _boxes.batched_nms(boxes, scores, torch.tensor([0, 0, 0]), 0.5).tolist() == [0]


def test_box_coding_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    anchors, targets = random_boxes(20, g), random_boxes(20, g)
    for weights in ((1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)):
        decoded = _boxes.decode(_boxes.encode(targets, anchors, weights), anchors, weights)
        assert torch.allclose(decoded, targets, atol=1e-4)


# -- RoIAlign -------------------------------------------------------------------------------------


def bilinear(feature: torch.Tensor, y: float, x: float) -> torch.Tensor:
    """torchvision's bilinear_interpolate (roi_align_kernel.cpp), transcribed."""
    _, height, width = feature.shape
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return feature.new_zeros(feature.shape[0])
    y, x = max(y, 0.0), max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_high = y_low = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_high = x_low = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1 - ly, 1 - lx
    return (
        hy * hx * feature[:, y_low, x_low]
        + hy * lx * feature[:, y_low, x_high]
        + ly * hx * feature[:, y_high, x_low]
        + ly * lx * feature[:, y_high, x_high]
    )


def reference_roi_align(features, rois, size, scale, ratio, aligned):  # type: ignore[no-untyped-def]
    """torchvision's roi_align forward, transcribed loop by loop (differentiable through torch ops)."""
    out = []
    offset = 0.5 if aligned else 0.0
    for b, x1, y1, x2, y2 in rois.tolist():
        start_x, start_y = x1 * scale - offset, y1 * scale - offset
        roi_w, roi_h = x2 * scale - offset - start_x, y2 * scale - offset - start_y
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_w, bin_h = roi_w / size, roi_h / size
        cells = []
        for ph in range(size):
            for pw in range(size):
                total = 0
                for iy in range(ratio):
                    y = start_y + ph * bin_h + (iy + 0.5) * bin_h / ratio
                    for ix in range(ratio):
                        x = start_x + pw * bin_w + (ix + 0.5) * bin_w / ratio
                        total = total + bilinear(features[int(b)], y, x)
                cells.append(total / (ratio * ratio))
        out.append(torch.stack(cells, dim=1).view(-1, size, size))
    return torch.stack(out)


@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_matches_torchvision_semantics(aligned: bool) -> None:
    g = torch.Generator().manual_seed(1)
    features = torch.randn(2, 3, 9, 11, generator=g, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor(
        [
            [0, 4.0, 4.0, 30.0, 20.0],  # inside
            [1, -10.0, -6.0, 12.0, 9.0],  # over the top-left edge
            [1, 30.0, 20.0, 50.0, 44.0],  # over the bottom-right edge
            [0, 10.0, 10.0, 11.0, 10.5],  # smaller than a feature pixel
            [1, 0.0, 0.0, 44.0, 36.0],  # the whole map
        ],
        dtype=torch.float64,
    )
    mine = _boxes.roi_align(features, rois, 3, 0.25, 2, aligned)
    reference = reference_roi_align(features, rois, 3, 0.25, 2, aligned)
    assert torch.allclose(mine, reference, atol=1e-10)
    weights = torch.randn(mine.shape, generator=g, dtype=torch.float64)
    (grad_mine,) = torch.autograd.grad((mine * weights).sum(), features)
    (grad_reference,) = torch.autograd.grad((reference * weights).sum(), features)
    assert torch.allclose(grad_mine, grad_reference, atol=1e-10)
    assert _boxes.roi_align(features, rois[:0], 3, 0.25).shape == (0, 3, 3, 3)


# -- COCO -----------------------------------------------------------------------------------------


def test_coco_is_read_resized_and_labelled(coco: Path) -> None:
    w = tiny(coco)
    train = w.train_dataset()
    assert len(train) == 8 and train.categories == [2, 5]  # COCO ids, in order -> labels 1, 2
    document = json.loads((coco / "annotations" / "instances_train2017.json").read_text())
    as_val = {"val_annotations": "annotations/instances_train2017.json", "val_images": "train2017"}
    val = tiny(coco, **as_val).val_dataset()
    image, boxes, labels = val[0]  # no flip in validation
    assert image.shape == (3, 128, 154)  # 96x80 scaled by 128/80 = 1.6
    x, y, bw, bh = document["annotations"][0]["bbox"]
    assert torch.allclose(boxes[0], torch.tensor([x, y, x + bw, y + bh]) * torch.tensor([154 / 96, 1.6] * 2))
    assert labels.tolist() == [1]
    assert w.build_model().num_classes == 3  # two categories and the background
    assert w.val_dataset() is None  # no instances_val2017.json


def test_training_flips_boxes_with_the_image(coco: Path) -> None:
    train = tiny(coco).train_dataset()
    torch.manual_seed(0)
    seen = {tuple(train[1][1][0].tolist()) for _ in range(12)}
    assert len(seen) == 2  # flipped and not
    (a, b) = sorted(seen)
    assert a[0] == pytest.approx(154 - b[2], abs=1e-4) and a[2] == pytest.approx(154 - b[0], abs=1e-4)


def test_crowds_degenerate_boxes_and_empty_images(coco: Path) -> None:
    path = coco / "annotations" / "instances_train2017.json"
    document = json.loads(path.read_text())
    first = document["images"][0]["id"]
    document["annotations"] = [a for a in document["annotations"] if a["image_id"] != first]
    document["annotations"] += [
        {"id": 900, "image_id": first, "category_id": 2, "bbox": [1, 1, 30, 30], "iscrowd": 1},
        {"id": 901, "image_id": first, "category_id": 2, "bbox": [5, 5, 0, 10]},
    ]
    path.write_text(json.dumps(document))
    image, boxes, labels = tiny(coco).train_dataset()[0]
    assert boxes.shape == (0, 4) and labels.shape == (0,)
    w = tiny(coco)
    (images, sizes, gt_boxes, gt_labels), _ = w.collate([(image, boxes, labels)])
    losses = w.build_model()(images, sizes, gt_boxes, gt_labels)  # an image with nothing in it still trains
    assert losses.shape == (4,) and torch.isfinite(losses).all() and losses[1] == losses[3] == 0


def test_collate_pads_images_and_boxes() -> None:
    w = tiny()
    a = (torch.ones(3, 100, 130), torch.tensor([[1.0, 2, 30, 40]]), torch.tensor([2]))
    b = (torch.ones(3, 128, 90), torch.tensor([[0.0, 0, 5, 5], [3, 3, 9, 9]]), torch.tensor([1, 3]))
    (images, sizes, boxes, labels), target = w.collate([a, b])
    assert images.shape == (2, 3, 128, 160) and images[0, :, 100:].abs().sum() == 0
    assert sizes.tolist() == [[100, 130], [128, 90]]
    assert boxes.shape == (2, 2, 4) and labels.tolist() == [[2, -1], [1, 3]]
    assert target is labels


def bad_annotations(coco: Path, document: object) -> list[str]:
    path = coco / "annotations" / "instances_train2017.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    with pytest.raises(InputError) as info:
        tiny(coco).train_dataset()
    return info.value.lines()


def test_bad_annotation_files_name_the_file_and_entry(coco: Path) -> None:
    path = coco / "annotations" / "instances_train2017.json"
    good = json.loads(path.read_text())
    assert bad_annotations(coco, '{"images": [1, 2,}') == [f"{path}: line 1 column 18: invalid JSON: Expecting value"]
    assert bad_annotations(coco, [1, 2]) == [f"{path}: expected a JSON object with images, annotations and categories"]
    assert bad_annotations(coco, {"images": {}}) == [
        f"{path}: images: expected a list, got a dict",
        f"{path}: annotations: expected a list, got missing",
        f"{path}: categories: expected a list, got missing",
    ]
    broken = {**good, "annotations": [dict(a) for a in good["annotations"]]}
    broken["annotations"][0]["bbox"] = [1, 2, 3]
    broken["annotations"][1]["image_id"] = 4242
    broken["annotations"][2]["category_id"] = [7]
    broken["annotations"][3]["bbox"] = [0, 0, -4, 5]
    assert bad_annotations(coco, broken) == [
        f"{path}: annotations[0].bbox: expected [x, y, width, height] (4 numbers), got [1, 2, 3]",
        f"{path}: annotations[1].image_id: no image with id 4242",
        f"{path}: annotations[2].category_id: no category with id [7]",
        f"{path}: annotations[3].bbox: width and height must not be negative, got [0, 0, -4, 5]",
    ]
    many = {**good, "images": [{"id": "x"}] * 30}
    lines = bad_annotations(coco, many)
    assert len(lines) == 21 and lines[-1].endswith("... and 22 more problems")  # 30 images, 12 annotations
    path.unlink()
    with pytest.raises(InputError, match="annotation file not found"):
        tiny(coco).train_dataset()


def test_missing_and_undecodable_images_are_skipped(coco: Path) -> None:
    (coco / "train2017" / "000000000001.jpg").unlink()
    (coco / "train2017" / "000000000002.jpg").write_bytes(b"\x89PNG broken")
    train = tiny(coco).train_dataset()
    assert len(train) == 7 and [p.name for p in train.skipped] == ["000000000001.jpg"]
    samples = [train[i] for i in range(len(train))]
    assert len(samples) == 7 and {p.name for p in train.skipped} == {"000000000001.jpg", "000000000002.jpg"}
    assert "2 image(s) could not be decoded" in train.summary() and "file not found" in train.summary()
    verified = tiny(coco, verify_images=True).train_dataset()
    assert len(verified) == 6 and len(verified.skipped) == 2

    for image in (coco / "train2017").iterdir():
        image.unlink()
    with pytest.raises(InputError, match="none of the 8 images listed"):
        tiny(coco).train_dataset()
    (coco / "train2017").rmdir()
    with pytest.raises(InputError, match="image folder not found"):
        tiny(coco).train_dataset()


def test_num_classes_option_must_agree_with_the_categories(coco: Path) -> None:
    with pytest.raises(InputError, match="has 2 categories"):
        tiny(coco, num_classes=10).build_model()
    assert tiny(coco, num_classes=3).build_model().num_classes == 3


# -- the model ------------------------------------------------------------------------------------


def test_parameter_counts() -> None:
    with torch.device("meta"):
        full = load_workload("faster_rcnn", {}).build_model()
        small = tiny().build_model()
    # torchvision's fasterrcnn_resnet50_fpn (41,755,286) plus its frozen BatchNorm affine parameters (53,120).
    assert sum(p.numel() for p in full.parameters()) == 41_808_406
    assert sum(p.numel() for p in small.parameters()) == 348_939


def test_synthetic_data_and_worst_case_batch() -> None:
    w = tiny()
    image, boxes, labels = w.train_dataset()[0]
    assert image.shape == (3, 128, 171) and boxes.shape[1] == 4 and 1 <= len(boxes) <= 3
    assert ((labels >= 1) & (labels <= 3)).all() and len(w.val_dataset()) == 64
    (images, sizes, gt_boxes, gt_labels), target = w.synthetic_batch(2)
    assert images.shape == (2, 3, 128, 224) and sizes.tolist() == [[128, 213]] * 2
    assert gt_boxes.shape == (2, 3, 4) and (gt_boxes[..., 2:] > gt_boxes[..., :2]).all()
    losses = w.build_model()(images, sizes, gt_boxes, gt_labels)
    assert losses.shape == (4,) and w.loss(losses, target).ndim == 0


def test_tiny_faster_rcnn_learns_coco_and_detects(coco: Path) -> None:
    w = tiny(coco)
    losses = train_losses(w, w.train_dataset(), batch_size=2, steps=40)
    assert mean(losses[-20:]) < 0.7 * mean(losses[:5]), losses
    model = w.build_model().eval()
    (images, sizes, _, _), _ = w.collate([w.train_dataset()[0], w.train_dataset()[1]])
    detections = model.detect(images, sizes)
    assert len(detections) == 2
    for found, (height, width) in zip(detections, sizes.tolist(), strict=True):
        assert found["boxes"].shape[1] == 4 and len(found["scores"]) == len(found["labels"]) <= 100
        assert (found["boxes"][:, 2] <= width).all() and (found["boxes"][:, 3] <= height).all()
        assert (found["scores"][:-1] >= found["scores"][1:]).all()
