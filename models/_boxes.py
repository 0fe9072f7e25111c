"""Box operations for detection, in plain PyTorch: IoU, box coding, NMS and RoIAlign.

torchvision's compiled operators (``torchvision.ops.nms``, ``roi_align``) do
not load with a CPU-only PyTorch, and torchvision has no CPU build to install
beside it, so the detection workload uses these instead. They follow
torchvision's semantics (tests compare them with direct transcriptions of its
reference algorithms) and run on any device.

Boxes are ``(x1, y1, x2, y2)`` in pixels, as float tensors of shape (N, 4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The largest log-scale change a decoded box may take (torchvision's bbox_xform_clip).
BOX_SCALE_CLAMP = math.log(1000.0 / 16)


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Intersection over union of every box of ``a`` (N, 4) with every box of ``b`` (M, 4): (N, M)."""
    top_left = torch.max(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=2)
    return inter / (box_area(a)[:, None] + box_area(b)[None, :] - inter)


def clip_boxes(boxes: torch.Tensor, height: int | torch.Tensor, width: int | torch.Tensor) -> torch.Tensor:
    x = boxes[..., 0::2].clamp(min=0, max=width)
    y = boxes[..., 1::2].clamp(min=0, max=height)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


def small_boxes(boxes: torch.Tensor, min_size: float) -> torch.Tensor:
    """A mask of the boxes narrower or lower than ``min_size``."""
    return ((boxes[:, 2] - boxes[:, 0]) < min_size) | ((boxes[:, 3] - boxes[:, 1]) < min_size)


def encode(targets: torch.Tensor, references: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Regression targets (dx, dy, dw, dh) that turn ``references`` into ``targets`` (both (N, 4))."""
    wx, wy, ww, wh = weights
    ref_w = references[:, 2] - references[:, 0]
    ref_h = references[:, 3] - references[:, 1]
    ref_x = references[:, 0] + 0.5 * ref_w
    ref_y = references[:, 1] + 0.5 * ref_h
    tgt_w = targets[:, 2] - targets[:, 0]
    tgt_h = targets[:, 3] - targets[:, 1]
    tgt_x = targets[:, 0] + 0.5 * tgt_w
    tgt_y = targets[:, 1] + 0.5 * tgt_h
    return torch.stack(
        [
            wx * (tgt_x - ref_x) / ref_w,
            wy * (tgt_y - ref_y) / ref_h,
            ww * torch.log(tgt_w / ref_w),
            wh * torch.log(tgt_h / ref_h),
        ],
        dim=1,
    )


def decode(deltas: torch.Tensor, references: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Apply ``deltas`` (N, 4k) to ``references`` (N, 4): boxes (N, 4k), k boxes per reference."""
    wx, wy, ww, wh = weights
    ref_w = (references[:, 2] - references[:, 0])[:, None]
    ref_h = (references[:, 3] - references[:, 1])[:, None]
    ref_x = references[:, 0, None] + 0.5 * ref_w
    ref_y = references[:, 1, None] + 0.5 * ref_h
    dx, dy = deltas[:, 0::4] / wx, deltas[:, 1::4] / wy
    dw = (deltas[:, 2::4] / ww).clamp(max=BOX_SCALE_CLAMP)
    dh = (deltas[:, 3::4] / wh).clamp(max=BOX_SCALE_CLAMP)
    x, y = dx * ref_w + ref_x, dy * ref_h + ref_y
    half_w, half_h = 0.5 * torch.exp(dw) * ref_w, 0.5 * torch.exp(dh) * ref_h
    return torch.stack([x - half_w, y - half_h, x + half_w, y + half_h], dim=2).flatten(1)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of the kept boxes, by decreasing score.

    A box is kept unless a higher-scoring *kept* box overlaps it by more than
    ``iou_threshold``. Computed without a Python loop over boxes: ``keep`` is
    iterated as ``keep[i] = no kept j before i overlaps i`` from all-True; after
    t rounds the first t entries are final, and the loop stops at the fixed
    point, which is the greedy answer (usually after a few rounds).
    """
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    order = scores.argsort(descending=True)
    sorted_boxes = boxes[order]
    overlaps = (box_iou(sorted_boxes, sorted_boxes) > iou_threshold).triu(diagonal=1)  # [j, i]: j before i
    keep = torch.ones(len(order), dtype=torch.bool, device=boxes.device)
    for _ in range(len(order)):
        new_keep = ~(overlaps & keep[:, None]).any(dim=0)
        if torch.equal(new_keep, keep):
            break
        keep = new_keep
    return order[keep]


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """NMS within each group (class or level) separately; indices by decreasing score."""
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    kept = []
    for group in torch.unique(groups):
        members = torch.nonzero(groups == group).squeeze(1)
        kept.append(members[nms(boxes[members], scores[members], iou_threshold)])
    keep = torch.cat(kept)
    return keep[scores[keep].argsort(descending=True)]


def roi_align(
    features: torch.Tensor,
    rois: torch.Tensor,
    output_size: int,
    spatial_scale: float,
    sampling_ratio: int = 2,
    aligned: bool = False,
) -> torch.Tensor:
    """RoIAlign (Mask R-CNN): features (N, C, H, W) and rois (K, 5) -> (K, C, output_size, output_size).

    Each roi is ``(batch index, x1, y1, x2, y2)`` in image coordinates;
    ``spatial_scale`` maps them onto the feature map. Every output bin
    averages ``sampling_ratio**2`` bilinear samples, with torchvision's
    conventions: samples more than one pixel outside the map count as zero,
    others are clamped to the map's edge; ``aligned=False`` (torchvision's
    Faster R-CNN default) makes every roi at least 1x1 feature pixel,
    ``aligned=True`` shifts boxes by half a pixel. The sampling ratio must be
    fixed (torchvision's adaptive ratio, 0, is not supported).

    Sampling uses ``grid_sample`` per image, so gradients reach ``features``
    and the memory needed is ``sampling_ratio**2`` times the output's.
    """
    if sampling_ratio < 1:
        raise ValueError("sampling_ratio must be at least 1")
    _, channels, height, width = features.shape
    k, s = len(rois), sampling_ratio
    out = features.new_zeros(k, channels, output_size, output_size)
    if k == 0:
        return out
    offset = 0.5 if aligned else 0.0
    rois = rois.to(features.dtype)
    x1, y1 = rois[:, 1] * spatial_scale - offset, rois[:, 2] * spatial_scale - offset
    roi_w, roi_h = rois[:, 3] * spatial_scale - offset - x1, rois[:, 4] * spatial_scale - offset - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
    steps = (torch.arange(output_size * s, device=features.device, dtype=features.dtype) + 0.5) / s
    xs = x1[:, None] + steps[None, :] * (roi_w / output_size)[:, None]  # (K, output_size * s)
    ys = y1[:, None] + steps[None, :] * (roi_h / output_size)[:, None]
    inside = ((ys >= -1.0) & (ys <= height))[:, :, None] & ((xs >= -1.0) & (xs <= width))[:, None, :]
    # With coordinates clamped to the pixel centres, grid_sample (align_corners=True) is exactly
    # torchvision's bilinear interpolation; the mask zeroes samples that fall off the map.
    gx = _normalise(xs.clamp(0, width - 1), width)
    gy = _normalise(ys.clamp(0, height - 1), height)
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), dim=-1)  # (K, S, S, 2)
    batch = rois[:, 0].long()
    for b in torch.unique(batch).tolist():
        members = torch.nonzero(batch == b).squeeze(1)
        g = grid[members]  # (k_b, S, S, 2)
        sampled = F.grid_sample(
            features[b : b + 1], g.reshape(1, -1, g.shape[2], 2), mode="bilinear", align_corners=True
        )  # (1, C, k_b * S, S)
        sampled = sampled.view(channels, len(members), g.shape[1], g.shape[2]).transpose(0, 1)
        sampled = sampled * inside[members, None].to(sampled.dtype)
        out[members] = F.avg_pool2d(sampled, s)
    return out


def _normalise(coordinate: torch.Tensor, size: int) -> torch.Tensor:
    """Pixel-centre coordinates in [0, size - 1] to grid_sample's [-1, 1] (align_corners=True)."""
    return coordinate * (2.0 / (size - 1)) - 1.0 if size > 1 else torch.zeros_like(coordinate)
