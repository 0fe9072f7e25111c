"""Faster R-CNN object detection with a ResNet-50-FPN backbone (and a tiny one), in plain PyTorch.

The model is the design of torchvision's ``fasterrcnn_resnet50_fpn``, the model
the seed's detection example trained (its code came from torchvision's
detection reference):

- backbone: a ResNet (``resnet`` workload's) and a feature pyramid (FPN)
  giving maps P2-P6 at strides 4-64;
- region proposal network (RPN): a 3x3 convolution and two 1x1 heads over
  every pyramid level, three anchors per location (aspect ratios 0.5, 1, 2;
  one size per level); proposals are decoded, clipped, and thinned by NMS per
  level;
- RoI heads: RoIAlign of each proposal on the pyramid level that matches its
  size (7x7, two samples per bin), a two-layer MLP, and per-class scores and
  box refinements.

Training follows torchvision's losses: anchors match ground truth at IoU 0.7 /
0.3 (and each box's best anchors), 256 sampled per image, half positive;
proposals (plus the ground-truth boxes) match at IoU 0.5, 512 sampled per image,
a quarter positive; binary cross-entropy and cross-entropy for scores,
smooth-L1 (beta 1/9) for boxes.

NMS and RoIAlign are this package's plain-PyTorch versions
(``jabascli.builtin_models._boxes``): torchvision's compiled operators do not
load with a CPU-only PyTorch, so the model never uses them.

Full size (``resnet50_fpn``, 91 classes as torchvision's COCO model) has
41,808,406 parameters: torchvision's 41,755,286 plus the 53,120 BatchNorm
scales and shifts that torchvision freezes for its pretrained backbone. This
model trains from scratch (nothing is downloaded), so its BatchNorm layers
train. The tiny variant (a ResNet of widths 8-64, a 32-channel pyramid,
128-pixel images, 4 classes: 348,939 parameters) is the one CPU tests and
profilers use.

**Interface.** A batch is ``((images, image_sizes, boxes, labels), labels)``
(see ``collate``): images padded to a common size, each image's own size, and
the ground truth padded with label -1. The model's forward takes the four
inputs and returns its four losses as one tensor (RPN objectness, RPN box,
classifier, box, in ``LOSS_NAMES`` order), each already a mean over its
sampled anchors or proposals; the workload's ``loss`` is their sum. The forward
pass computes losses in evaluation mode too (with the test-time proposal
counts), which is the validation loss. ``model.detect(images, image_sizes)``
returns the detections, one dict of ``boxes``, ``scores``, ``labels`` per image,
in the input's pixel coordinates. There is no accuracy count (mAP is out of
scope).

Data: with ``[job] data`` set, COCO 2017 layout (see
``jabascli.builtin_models._coco``): ``<data>/annotations/instances_train2017.json``
and ``<data>/train2017/``, and the same for val2017 (optional); else generated
images of coloured rectangles. Images are resized so the shorter side is
``min_size`` (800) unless the longer exceeds ``max_size`` (1333).

Seed settings (``jabas_config_example_faster_r_cnn.json`` and the seed's
README): global batch size 16 to 192, similarity target 0.1, local batch size
2 (2 VSWs per GPU in the seed's worker example). Detection runs very small local
batches; IIDP's equal-LBS rule keeps faster GPUs busy with more VSWs and GA
steps instead. ``examples/faster_rcnn.toml`` holds them.

Options (``[job] options``), with their defaults for ``resnet50_fpn`` / ``tiny``:

- ``num_classes`` (91 / 4): classes including the background; with data, the
  annotation file's categories + 1.
- ``min_size`` (800 / 128), ``max_size`` (1333 / 213): image sides after
  resizing.
- ``lr`` (0.02 / 0.01), ``momentum`` (0.9), ``weight_decay`` (1e-4): SGD, the
  learning rate at the initial global batch size; no weight decay on norms and
  biases.
- ``warmup_iters`` (1000 / 0): linear learning-rate warm-up iterations.
- ``train_annotations`` (annotations/instances_train2017.json),
  ``train_images`` (train2017), ``val_annotations``
  (annotations/instances_val2017.json), ``val_images`` (val2017): the data's
  files, relative to ``[job] data``.
- ``synthetic_size`` (118,287 / 256): training images without data.
- ``verify_images`` (false): decode every image before training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jabascli.builtin_models import _boxes, _coco
from jabascli.builtin_models._optim import sgd, warmup
from jabascli.builtin_models._options import Spec, resolve
from jabascli.builtin_models.resnet import BasicBlock, ResNet, resnet50
from jabascli.errors import InputError

NAME = "faster_rcnn"
LOSS_NAMES = ("rpn_objectness", "rpn_box", "classifier", "box")

SPECS = {
    "num_classes": Spec(int, "classes including background (with data: categories + 1)", minimum=2, optional=True),
    "min_size": Spec(int, "shorter image side after resizing", minimum=32),
    "max_size": Spec(int, "longest image side after resizing", minimum=32),
    "lr": Spec(float, "SGD learning rate", minimum=0),
    "momentum": Spec(float, "SGD momentum", minimum=0),
    "weight_decay": Spec(float, "L2 penalty on weights (not norms or biases)", minimum=0),
    "warmup_iters": Spec(int, "linear learning-rate warm-up iterations", minimum=0),
    "train_annotations": Spec(str, "training annotation file, relative to data"),
    "train_images": Spec(str, "training image folder, relative to data"),
    "val_annotations": Spec(str, "validation annotation file, relative to data"),
    "val_images": Spec(str, "validation image folder, relative to data"),
    "synthetic_size": Spec(int, "training images when no data is given", minimum=1),
    "verify_images": Spec(bool, "decode every image before training"),
}
_COCO2017 = {
    "num_classes": None,
    "lr": 0.02,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "train_annotations": "annotations/instances_train2017.json",
    "train_images": "train2017",
    "val_annotations": "annotations/instances_val2017.json",
    "val_images": "val2017",
    "verify_images": False,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "resnet50_fpn": {**_COCO2017, "min_size": 800, "max_size": 1333, "warmup_iters": 1000, "synthetic_size": 118_287},
    "tiny": {**_COCO2017, "lr": 0.01, "min_size": 128, "max_size": 213, "warmup_iters": 0, "synthetic_size": 256},
}
DEFAULT_CLASSES = {"resnet50_fpn": 91, "tiny": 4}
SYNTHETIC_VAL_SIZE = {"resnet50_fpn": 5000, "tiny": 64}


@dataclass(frozen=True)
class Architecture:
    backbone: str
    fpn_channels: int
    anchor_sizes: tuple[int, ...]
    """One anchor size per pyramid level, P2 to P6."""
    representation: int
    """Width of the box head's MLP."""
    rpn_pre_nms: tuple[int, int]
    """Top-scoring anchors per level kept before NMS (training, evaluation)."""
    rpn_post_nms: tuple[int, int]
    """Proposals per image kept after NMS (training, evaluation)."""
    rpn_batch: int
    roi_batch: int
    aspect_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    rpn_iou: tuple[float, float] = (0.7, 0.3)
    rpn_nms: float = 0.7
    roi_iou: float = 0.5
    detection_score: float = 0.05
    detection_nms: float = 0.5
    detections: int = 100


ARCHITECTURES = {
    "resnet50_fpn": Architecture("resnet50", 256, (32, 64, 128, 256, 512), 1024, (2000, 1000), (2000, 1000), 256, 512),
    "tiny": Architecture("tiny", 32, (16, 32, 64, 128, 256), 128, (300, 200), (150, 100), 64, 64),
}
RPN_WEIGHTS = (1.0, 1.0, 1.0, 1.0)
ROI_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
ROI_SIZE = 7
SMOOTH_L1_BETA = 1 / 9


def settings(options: dict[str, Any]) -> Any:
    return resolve(options, SPECS, VARIANTS, "resnet50_fpn")


class FeaturePyramid(nn.Module):
    """FPN: lateral 1x1 and output 3x3 convolutions, top-down nearest upsampling, and a max-pooled P6."""

    def __init__(self, in_channels: list[int], channels: int) -> None:
        super().__init__()
        self.inner_blocks = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.layer_blocks = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in in_channels)
        for conv in [*self.inner_blocks, *self.layer_blocks]:
            nn.init.kaiming_uniform_(conv.weight, a=1)
            nn.init.zeros_(conv.bias)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        top = self.inner_blocks[-1](features[-1])
        outputs = [self.layer_blocks[-1](top)]
        for i in range(len(features) - 2, -1, -1):
            lateral = self.inner_blocks[i](features[i])
            top = lateral + F.interpolate(top, size=lateral.shape[-2:], mode="nearest")
            outputs.insert(0, self.layer_blocks[i](top))
        outputs.append(F.max_pool2d(outputs[-1], 1, stride=2))
        return outputs


class Backbone(nn.Module):
    def __init__(self, body: ResNet, channels: int) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramid(body.out_channels, channels)

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        return self.fpn(self.body.stages(images))


class RPNHead(nn.Module):
    def __init__(self, channels: int, anchors: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.cls_logits = nn.Conv2d(channels, anchors, 1)
        self.bbox_pred = nn.Conv2d(channels, 4 * anchors, 1)
        for conv in (self.conv, self.cls_logits, self.bbox_pred):
            nn.init.normal_(conv.weight, std=0.01)
            nn.init.zeros_(conv.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.conv(x))
        return self.cls_logits(x), self.bbox_pred(x)


class BoxHead(nn.Module):
    """RoI features -> two fully connected layers -> class scores and per-class box deltas."""

    def __init__(self, in_features: int, representation: int, num_classes: int) -> None:
        super().__init__()
        self.fc6 = nn.Linear(in_features, representation)
        self.fc7 = nn.Linear(representation, representation)
        self.cls_score = nn.Linear(representation, num_classes)
        self.bbox_pred = nn.Linear(representation, 4 * num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc7(F.relu(self.fc6(x.flatten(1)))))
        return self.cls_score(x), self.bbox_pred(x)


def base_anchors(size: int, ratios: tuple[float, ...]) -> torch.Tensor:
    """Anchors of one size and the given height/width ratios, centred on 0 and rounded: (len(ratios), 4)."""
    h = torch.tensor(ratios).sqrt()
    w = 1 / h
    half = torch.stack([-w * size, -h * size, w * size, h * size], dim=1) / 2
    return half.round()


def match(iou: torch.Tensor, high: float, low: float, allow_low_quality: bool) -> torch.Tensor:
    """For every column (anchor or proposal) of ``iou`` (boxes x candidates): its box, -1 below ``low``,
    -2 between ``low`` and ``high``. With ``allow_low_quality``, each box's best candidates match it anyway."""
    values, matches = iou.max(dim=0)
    best = matches.clone()
    matches[values < low] = -1
    matches[(values >= low) & (values < high)] = -2
    if allow_low_quality:
        highest = iou.max(dim=1).values
        _, candidates = torch.nonzero((iou == highest[:, None]) & (highest[:, None] > 0), as_tuple=True)
        matches[candidates] = best[candidates]
    return matches


def sample(labels: torch.Tensor, batch: int, positive_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positive (label > 0) and negative (label == 0) indices: at most ``batch``, a share positive."""
    positive = torch.nonzero(labels > 0).squeeze(1)
    negative = torch.nonzero(labels == 0).squeeze(1)
    n_pos = min(int(batch * positive_fraction), len(positive))
    n_neg = min(batch - n_pos, len(negative))
    positive = positive[torch.randperm(len(positive), device=labels.device)[:n_pos]]
    negative = negative[torch.randperm(len(negative), device=labels.device)[:n_neg]]
    return positive, negative


class FasterRCNN(nn.Module):
    def __init__(self, arch: Architecture, num_classes: int) -> None:
        super().__init__()
        self.arch, self.num_classes = arch, num_classes
        if arch.backbone == "resnet50":
            body = resnet50(num_classes=None)
        else:
            body = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=None, widths=(8, 16, 32, 64))
        self.backbone = Backbone(body, arch.fpn_channels)
        self.rpn_head = RPNHead(arch.fpn_channels, len(arch.aspect_ratios))
        self.box_head = BoxHead(arch.fpn_channels * ROI_SIZE * ROI_SIZE, arch.representation, num_classes)
        anchors = [base_anchors(size, arch.aspect_ratios) for size in arch.anchor_sizes]
        self.register_buffer("base_anchors", torch.stack(anchors), persistent=False)

    # -- the pieces ---------------------------------------------------------------------------

    def anchors(self, features: list[torch.Tensor], padded_hw: tuple[int, int]) -> tuple[torch.Tensor, list[int]]:
        """All anchors of the padded image, level by level, location-major: (N, 4), and the count per level."""
        per_level = []
        for level, feature in enumerate(features):
            fh, fw = feature.shape[-2:]
            sy, sx = padded_hw[0] // fh, padded_hw[1] // fw
            ys = torch.arange(fh, device=feature.device, dtype=torch.float32) * sy
            xs = torch.arange(fw, device=feature.device, dtype=torch.float32) * sx
            y, x = torch.meshgrid(ys, xs, indexing="ij")
            shifts = torch.stack([x, y, x, y], dim=-1).reshape(-1, 1, 4)
            per_level.append((shifts + self.base_anchors[level].to(feature.device)).reshape(-1, 4))
        return torch.cat(per_level), [len(a) for a in per_level]

    def rpn(
        self,
        features: list[torch.Tensor],
        padded_hw: tuple[int, int],
        image_sizes: torch.Tensor,
        targets: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Proposals per image, and the RPN's two losses when ``targets`` are given."""
        logits, deltas = [], []
        for feature in features:
            o, d = self.rpn_head(feature)
            b, a, h, w = o.shape
            logits.append(o.permute(0, 2, 3, 1).reshape(b, -1))
            deltas.append(d.view(b, a, 4, h, w).permute(0, 3, 4, 1, 2).reshape(b, -1, 4))
        logits_all, deltas_all = torch.cat(logits, dim=1), torch.cat(deltas, dim=1)
        anchors, counts = self.anchors(features, padded_hw)
        batch = logits_all.shape[0]
        boxes = _boxes.decode(deltas_all.detach().reshape(-1, 4), anchors.repeat(batch, 1), RPN_WEIGHTS)
        proposals = self._proposals(boxes.view(batch, -1, 4), logits_all.detach(), counts, image_sizes)
        if targets is None:
            return proposals, []
        return proposals, self._rpn_losses(logits_all, deltas_all, anchors, targets)

    def _proposals(
        self, boxes: torch.Tensor, logits: torch.Tensor, counts: list[int], image_sizes: torch.Tensor
    ) -> list[torch.Tensor]:
        phase = 0 if self.training else 1
        pre_nms, post_nms = self.arch.rpn_pre_nms[phase], self.arch.rpn_post_nms[phase]
        top, levels, start = [], [], 0
        for level, count in enumerate(counts):
            k = min(pre_nms, count)
            top.append(logits[:, start : start + count].topk(k, dim=1).indices + start)
            levels.append(torch.full((k,), level, device=logits.device))
            start += count
        top_all, level_all = torch.cat(top, dim=1), torch.cat(levels)
        proposals = []
        for i in range(len(boxes)):
            height, width = image_sizes[i].tolist()
            box = _boxes.clip_boxes(boxes[i, top_all[i]], height, width)
            score = torch.sigmoid(logits[i, top_all[i]])
            keep = ~_boxes.small_boxes(box, 1e-3)
            box, score, level = box[keep], score[keep], level_all[keep]
            keep = _boxes.batched_nms(box, score, level, self.arch.rpn_nms)[:post_nms]
            proposals.append(box[keep])
        return proposals

    def _rpn_losses(
        self,
        logits: torch.Tensor,
        deltas: torch.Tensor,
        anchors: torch.Tensor,
        targets: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> list[torch.Tensor]:
        high, low = self.arch.rpn_iou
        positives, negatives, regression = [], [], []
        for i, (gt_boxes, _) in enumerate(targets):
            if len(gt_boxes):
                matches = match(_boxes.box_iou(gt_boxes, anchors), high, low, allow_low_quality=True)
                labels = (matches >= 0).to(torch.int64)
                labels[matches == -2] = -1
            else:
                matches = torch.full((len(anchors),), -1, dtype=torch.int64, device=anchors.device)
                labels = torch.zeros(len(anchors), dtype=torch.int64, device=anchors.device)
            pos, neg = sample(labels, self.arch.rpn_batch, 0.5)
            regression.append(_boxes.encode(gt_boxes[matches[pos]], anchors[pos], RPN_WEIGHTS))
            positives.append(pos + i * len(anchors))
            negatives.append(neg + i * len(anchors))
        pos, neg = torch.cat(positives), torch.cat(negatives)
        sampled = torch.cat([pos, neg])
        flat_logits = logits.reshape(-1)
        objectness = F.binary_cross_entropy_with_logits(
            flat_logits[sampled], torch.cat([torch.ones_like(pos), torch.zeros_like(neg)]).to(flat_logits.dtype)
        )
        box = F.smooth_l1_loss(
            deltas.reshape(-1, 4)[pos], torch.cat(regression), beta=SMOOTH_L1_BETA, reduction="sum"
        ) / max(1, len(sampled))
        return [objectness, box]

    def roi_features(self, features: list[torch.Tensor], rois: torch.Tensor) -> torch.Tensor:
        """RoIAlign of each roi (batch index, box) on the level P2-P5 that suits its size: (K, C, 7, 7)."""
        size = _boxes.box_area(rois[:, 1:]).clamp(min=0).sqrt()
        level = (torch.floor(4 + torch.log2(size / 224 + 1e-8) + 1e-6).clamp(2, 5) - 2).long()
        out = features[0].new_zeros(len(rois), features[0].shape[1], ROI_SIZE, ROI_SIZE)
        for lvl in range(4):
            members = torch.nonzero(level == lvl).squeeze(1)
            if len(members):
                out[members] = _boxes.roi_align(features[lvl], rois[members], ROI_SIZE, 1 / 2 ** (lvl + 2))
        return out

    def _roi_losses(
        self, features: list[torch.Tensor], proposals: list[torch.Tensor], targets: list[tuple[torch.Tensor, ...]]
    ) -> list[torch.Tensor]:
        rois, labels, regression = [], [], []
        for i, ((gt_boxes, gt_labels), boxes) in enumerate(zip(targets, proposals, strict=True)):
            boxes = torch.cat([boxes, gt_boxes])
            if len(gt_boxes):
                matches = match(_boxes.box_iou(gt_boxes, boxes), self.arch.roi_iou, self.arch.roi_iou, False)
                box_labels = gt_labels[matches.clamp(min=0)]
                box_labels[matches < 0] = 0
            else:
                matches = torch.zeros(len(boxes), dtype=torch.int64, device=boxes.device)
                box_labels = torch.zeros(len(boxes), dtype=torch.int64, device=boxes.device)
            pos, neg = sample(box_labels, self.arch.roi_batch, 0.25)
            kept = torch.cat([pos, neg])
            targets_pos = _boxes.encode(gt_boxes[matches[pos]], boxes[pos], ROI_WEIGHTS)
            regression.append(torch.cat([targets_pos, targets_pos.new_zeros(len(neg), 4)]))
            labels.append(box_labels[kept])
            rois.append(torch.cat([torch.full_like(boxes[kept, :1], i), boxes[kept]], dim=1))
        rois_all, labels_all = torch.cat(rois), torch.cat(labels)
        class_logits, box_deltas = self.box_head(self.roi_features(features, rois_all))
        classifier = F.cross_entropy(class_logits, labels_all)
        pos = torch.nonzero(labels_all > 0).squeeze(1)
        chosen = box_deltas.view(len(rois_all), -1, 4)[pos, labels_all[pos]]
        box = F.smooth_l1_loss(chosen, torch.cat(regression)[pos], beta=SMOOTH_L1_BETA, reduction="sum")
        return [classifier, box / max(1, len(labels_all))]

    # -- training and inference -------------------------------------------------------------

    def forward(
        self, images: torch.Tensor, image_sizes: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The four losses (``LOSS_NAMES``) of a batch as one tensor; ``labels`` -1 marks padding."""
        targets = [(b[lab >= 0], lab[lab >= 0]) for b, lab in zip(boxes, labels, strict=True)]
        features = self.backbone(images)
        proposals, rpn_losses = self.rpn(features, images.shape[-2:], image_sizes, targets)
        return torch.stack(rpn_losses + self._roi_losses(features[:4], proposals, targets))

    @torch.no_grad()
    def detect(self, images: torch.Tensor, image_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Detections per image: ``boxes`` (D, 4), ``scores`` (D,), ``labels`` (D,), best first."""
        features = self.backbone(images)
        proposals, _ = self.rpn(features, images.shape[-2:], image_sizes, None)
        rois = torch.cat([torch.cat([torch.full_like(p[:, :1], i), p], dim=1) for i, p in enumerate(proposals)])
        class_logits, box_deltas = self.box_head(self.roi_features(features[:4], rois))
        scores_all = torch.softmax(class_logits, dim=-1)
        boxes_all = _boxes.decode(box_deltas, rois[:, 1:], ROI_WEIGHTS).view(len(rois), -1, 4)
        results, start = [], 0
        for i, p in enumerate(proposals):
            height, width = image_sizes[i].tolist()
            boxes = _boxes.clip_boxes(boxes_all[start : start + len(p), 1:], height, width).reshape(-1, 4)
            scores = scores_all[start : start + len(p), 1:].reshape(-1)
            labels = torch.arange(1, self.num_classes, device=boxes.device).repeat(len(p))
            start += len(p)
            keep = (scores > self.arch.detection_score) & ~_boxes.small_boxes(boxes, 1e-2)
            boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
            keep = _boxes.batched_nms(boxes, scores, labels, self.arch.detection_nms)[: self.arch.detections]
            results.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
        return results


# -- the workload -----------------------------------------------------------------------------


def _paths(s: Any, split: str) -> tuple[Path, Path]:
    return s.data / getattr(s, f"{split}_annotations"), s.data / getattr(s, f"{split}_images")


@cache
def _category_count(path: Path, mtime_ns: int, size: int) -> int:
    return len(_coco.read_annotations(path)["categories"])


def num_classes(s: Any) -> int:
    """Classes including background: the annotation file's categories + 1, else the option, else the default.

    The count is read once per process and annotation file (COCO's is large, and profilers
    build the model many times).
    """
    if s.data is None:
        return s.num_classes or DEFAULT_CLASSES[s.variant]
    annotations = _paths(s, "train")[0]
    if not annotations.is_file():
        _coco.read_annotations(annotations)  # raises the error that names the file
    stat = annotations.stat()
    found = _category_count(annotations.resolve(), stat.st_mtime_ns, stat.st_size) + 1
    if s.num_classes is not None and s.num_classes != found:
        raise InputError.at(
            annotations,
            None,
            f"has {found - 1} categories ({found} classes with background) but [job] options num_classes is "
            f"{s.num_classes}; remove the option or fix it",
        )
    return found


def build_model(options: dict[str, Any]) -> nn.Module:
    s = settings(options)
    return FasterRCNN(ARCHITECTURES[s.variant], num_classes(s))


def _dataset(s: Any, split: str) -> torch.utils.data.Dataset:
    annotations, images = _paths(s, split)
    dataset = _coco.CocoDetection(annotations, images, s.min_size, s.max_size, train=split == "train")
    if s.verify_images:
        dataset.verify()
    return dataset


def _synthetic_hw(s: Any) -> tuple[int, int]:
    """A 4:3 image at the model's input size."""
    return s.min_size, min(s.max_size, round(s.min_size * 4 / 3))


def train_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset:
    s = settings(options)
    if s.data is None:
        return _coco.SyntheticDetection(s.synthetic_size, num_classes(s), *_synthetic_hw(s), seed=0)
    return _dataset(s, "train")


def val_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset | None:
    """The val2017 split; None (no validation) when its annotation file is absent."""
    s = settings(options)
    if s.data is None:
        return _coco.SyntheticDetection(SYNTHETIC_VAL_SIZE[s.variant], num_classes(s), *_synthetic_hw(s), seed=1)
    if not _paths(s, "val")[0].exists():
        return None
    return _dataset(s, "val")


collate = _coco.collate_detection


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum of the model's four losses (each a mean over its sampled anchors or proposals)."""
    return output.sum()


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    s = settings(options)
    return sgd(params, s.lr, s.momentum, s.weight_decay)


def lr_scheduler(opt: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    return warmup(opt, settings(options).warmup_iters)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Images at the largest input size (min_size x max_size, padded), three boxes each: the memory worst case."""
    s = settings(options)
    height, width = (math.ceil(v / _coco.SIZE_DIVISIBLE) * _coco.SIZE_DIVISIBLE for v in (s.min_size, s.max_size))
    images = torch.randn(batch_size, 3, height, width)
    sizes = torch.tensor([[s.min_size, s.max_size]] * batch_size)
    corner = torch.rand(batch_size, 3, 2) * torch.tensor([s.max_size, s.min_size]) * 0.5
    extent = (0.1 + 0.4 * torch.rand(batch_size, 3, 2)) * torch.tensor([s.max_size, s.min_size])
    boxes = torch.cat([corner, corner + extent], dim=2)
    labels = torch.randint(1, num_classes(s), (batch_size, 3))
    return (images, sizes, boxes, labels), labels
