"""The image classifiers trained in the course assignments, for 28x28 or 32x32 inputs of 1 or 3 channels.

``build_model(name, in_channels, num_classes, image_size)`` makes ``"net"`` (the week-4 template
network), ``"vgg11"``, ``"resnet18"`` or ``"resnet34"``. Every model maps float ``[N, in_channels,
H, W]`` to logits ``[N, num_classes]`` and normalises only with ``torch.nn.BatchNorm1d/2d``, which
the training script may swap for ddpkit's SyncBatchNorm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TemplateNet(nn.Module):
    """The week-4 assignment's template network, for ``image_size`` x ``image_size`` inputs.

    Two unpadded 3x3 convolutions and a 2x2 max-pool leave ``s = (image_size - 4) // 2`` pixels a
    side, so ``fc1`` takes ``32 * s * s`` features (4608 at 28x28, 6272 at 32x32). Its input size is
    fixed by ``image_size``; other sizes fail in ``fc1``.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        if image_size < 6:
            raise ValueError(f"ddpkit: TemplateNet needs image_size >= 6, got {image_size}")
        side = (image_size - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.bn1 = nn.BatchNorm1d(128, affine=False)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.bn1(self.fc1(x)))
        x = self.dropout2(x)
        return self.fc2(x)


VGG11_CONFIG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(nn.Module):
    """VGG-11 with batch norm, as in the CS744 assignment: 3x3 conv (padding 1) + BatchNorm2d + ReLU
    blocks per ``VGG11_CONFIG`` ("M" = 2x2 max-pool), then ``Linear(512, num_classes)``.

    The max-pools round up (``ceil_mode``) and an adaptive average pool ends the features at 1x1,
    so 28x28 inputs work (28 -> 14 -> 7 -> 4 -> 2 -> 1); on 32x32 both are the identity of the
    original (32 -> ... -> 1).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG11_CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1), nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
                channels = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm2d layers with an identity shortcut, or a strided 1x1 conv + BatchNorm2d
    shortcut where the block changes resolution or width."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet of ``BasicBlock``s: a 3x3 stride-1 stem without max-pool (small inputs keep
    their resolution), four stages of 64/128/256/512 channels (stages 2-4 halve the resolution),
    adaptive average pool and a linear head, for inputs of any size (28x28 and 32x32 alike)."""

    def __init__(self, blocks_per_stage: Sequence[int], in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, 1, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True)
        )
        stages: list[nn.Module] = []
        channels = 64
        for index, (width, count) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
            stride = 1 if index == 0 else 2
            blocks = [BasicBlock(channels, width, stride)] + [BasicBlock(width, width) for _ in range(count - 1)]
            stages.append(nn.Sequential(*blocks))
            channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def ResNet18(in_channels: int = 3, num_classes: int = 10) -> ResNet:
    return ResNet((2, 2, 2, 2), in_channels, num_classes)


def ResNet34(in_channels: int = 3, num_classes: int = 10) -> ResNet:
    return ResNet((3, 4, 6, 3), in_channels, num_classes)


_BUILDERS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "net": lambda in_channels, num_classes, image_size: TemplateNet(in_channels, num_classes, image_size),
    "vgg11": lambda in_channels, num_classes, image_size: VGG11(in_channels, num_classes),
    "resnet18": lambda in_channels, num_classes, image_size: ResNet18(in_channels, num_classes),
    "resnet34": lambda in_channels, num_classes, image_size: ResNet34(in_channels, num_classes),
}
MODELS = tuple(_BUILDERS)


def build_model(name: str, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """Model ``name`` (one of ``MODELS``) for ``[N, in_channels, image_size, image_size]`` inputs.

    Only ``"net"`` depends on ``image_size``; the others pool adaptively and accept any size.
    """
    if name not in _BUILDERS:
        raise ValueError(f"ddpkit: unknown model {name!r}; expected one of {list(MODELS)}")
    if in_channels < 1 or num_classes < 1:
        raise ValueError(f"ddpkit: in_channels and num_classes must be >= 1, got {in_channels} and {num_classes}")
    return _BUILDERS[name](in_channels, num_classes, image_size)
