"""ResNet image classification: ResNet-50, ResNet-18 and a tiny ResNet.

The architecture is ResNet v1.5 (the stride-2 convolution of a bottleneck
block sits on its 3x3 convolution), the variant of torchvision's ``resnet50``
and of NVIDIA's ResNet-50 v1.5 that the seed's example trained; parameter
counts match torchvision's: ResNet-50 25,557,032 (97.5 MiB of float32),
ResNet-18 11,689,512. The tiny variant (two 3x3 convolutions per stage, one
block per stage, widths 16-128, a 3x3 stem without max-pool for 32x32 images,
10 classes: 308,826 parameters) is the one CPU tests and profilers use.

Data: with ``[job] data`` set, an ImageFolder tree ``<data>/train/<class>/<image>``
and optionally ``<data>/val/<class>/<image>`` (the ImageNet layout); the class
count comes from train/. Training images get a random resized crop and a
horizontal flip, validation images a resize and centre crop; undecodable images
are skipped and counted (``dataset.skipped``, ``dataset.summary()``). Without
data, generated class-conditional images (ImageNet-sized epochs for the
full-size variants: 1,281,167 training and 50,000 validation samples).

Seed settings (``jabas_config_example_resnet50.json`` and the seed's ResNet-50
README): global batch size 256 to 32,768, similarity target 0.1, local batch
size 32 (the seed's worker example: LBS 32 with 2 VSWs per GPU).
``examples/resnet50.toml`` holds them.

Options (``[job] options``), with their defaults for ``resnet50`` and
``resnet18`` / ``tiny``:

- ``num_classes`` (1000 / 10): with data, the number of class folders.
- ``image_size`` (224 / 32): the side of the square crops.
- ``lr`` (0.1), ``momentum`` (0.9), ``weight_decay`` (1e-4 / 5e-4): SGD, the
  learning rate at the initial global batch size; no weight decay on
  BatchNorm and biases.
- ``warmup_iters`` (0): linear learning-rate warm-up iterations.
- ``synthetic_size`` (1,281,167 / 2,048): training images without data.
- ``verify_images`` (false): decode every image before training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jabascli.builtin_models import _images
from jabascli.builtin_models._classify import count_correct as count_correct
from jabascli.builtin_models._classify import loss as loss
from jabascli.builtin_models._optim import sgd, warmup
from jabascli.builtin_models._options import Spec, resolve

NAME = "resnet"

SPECS = _images.classifier_specs(
    image_size=Spec(int, "side of the square training crop", minimum=8),
    lr=Spec(float, "SGD learning rate", minimum=0),
    momentum=Spec(float, "SGD momentum", minimum=0),
    weight_decay=Spec(float, "L2 penalty on weights (not BatchNorm or biases)", minimum=0),
)
_COMMON = {"num_classes": None, "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "warmup_iters": 0}
_IMAGENET = {**_COMMON, "image_size": 224, "synthetic_size": 1_281_167, "verify_images": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "resnet50": _IMAGENET,
    "resnet18": _IMAGENET,
    "tiny": {**_IMAGENET, "image_size": 32, "weight_decay": 5e-4, "synthetic_size": 2048},
}
DEFAULT_CLASSES = {"resnet50": 1000, "resnet18": 1000, "tiny": 10}
SYNTHETIC_VAL_SIZE = {"resnet50": 50_000, "resnet18": 50_000, "tiny": 512}


def settings(options: dict[str, Any]) -> Any:
    return resolve(options, SPECS, VARIANTS, "resnet50")


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        # The shortcut runs after the main path, as in torchvision (which the seed
        # used): that fixes DDP's gradient-ready order, and so its buckets.
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity, inplace=True)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand by 4, with a shortcut (ResNet-50 and up)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(in_planes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)  # after, as in BasicBlock
        return F.relu(out + identity, inplace=True)


class ResNet(nn.Module):
    """A ResNet: stem, four stages of residual blocks, global average pool, linear classifier.

    ``stem="imagenet"`` is the 7x7 stride-2 convolution and 3x3 max-pool (input
    downsampled 4x before stage 1); ``stem="small"`` a 3x3 stride-1 convolution
    for 32x32 images. With ``num_classes=None`` there is no pool or classifier
    and :meth:`stages` is the way in (a detection backbone).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int | None = 1000,
        widths: tuple[int, int, int, int] = (64, 128, 256, 512),
        stem: str = "imagenet",
    ) -> None:
        super().__init__()
        self.in_planes = widths[0]
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = conv3x3(3, widths[0])
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.layer1 = self._stage(block, widths[0], layers[0], stride=1)
        self.layer2 = self._stage(block, widths[1], layers[1], stride=2)
        self.layer3 = self._stage(block, widths[2], layers[2], stride=2)
        self.layer4 = self._stage(block, widths[3], layers[3], stride=2)
        self.out_channels = [w * block.expansion for w in widths]
        self.fc = None if num_classes is None else nn.Linear(self.out_channels[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.in_planes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.in_planes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.in_planes, planes, stride, downsample)]
        self.in_planes = planes * block.expansion
        layers += [block(self.in_planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def stages(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of the four stages (strides 4, 8, 16, 32 with the ImageNet stem)."""
        x = self.maxpool(F.relu(self.bn1(self.conv1(x)), inplace=True))
        outputs = []
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = layer(x)
            outputs.append(x)
        return outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc is None:
            raise RuntimeError("this ResNet has no classifier (num_classes=None); use stages()")
        features = self.stages(x)[-1]
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))


def resnet50(num_classes: int | None = 1000) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)


def resnet18(num_classes: int | None = 1000) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet_tiny(num_classes: int | None = 10) -> ResNet:
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes, widths=(16, 32, 64, 128), stem="small")


ARCHITECTURES = {"resnet50": resnet50, "resnet18": resnet18, "tiny": resnet_tiny}


def num_classes(s: Any) -> int:
    return _images.num_classes(s.data, s.num_classes, DEFAULT_CLASSES[s.variant])


def build_model(options: dict[str, Any]) -> nn.Module:
    s = settings(options)
    return ARCHITECTURES[s.variant](num_classes(s))


def train_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset:
    s = settings(options)
    return _images.train_split(s, num_classes(s))


def val_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset | None:
    """The val/ split; None (no validation) when the data has no val/ folder."""
    s = settings(options)
    return _images.val_split(s, num_classes(s), SYNTHETIC_VAL_SIZE[s.variant])


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    s = settings(options)
    return sgd(params, s.lr, s.momentum, s.weight_decay)


def lr_scheduler(opt: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    return warmup(opt, settings(options).warmup_iters)


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    s = settings(options)
    return _images.random_batch(batch_size, s.image_size, num_classes(s))
