"""Three Fashion-MNIST classifiers unlike the demo model, for the defaults benchmark (``benchmarks/defaults.py``).

Each takes ``1×28×28`` images and builds its trained layout from its
constructor defaults, so a saved ``state_dict`` loads with
``--arch benchmarks._fashion_models:NAME`` (with the repository root on
``PYTHONPATH``). They differ from ``optkit.demo.fashion_resnet`` and from each
other in the blocks torch-pruning has to follow:

- :class:`PlainVGG`: a plain conv-BN-ReLU stack with max pooling and a
  two-layer classifier (a hidden ``Linear`` + ``BatchNorm1d``), no shortcuts;
- :class:`BottleneckResNet`: deeper, two bottleneck blocks (1×1, 3×3, 1×1)
  per stage whose residual adds tie the channels of a whole stage together;
- :class:`MobileNetLike`: MobileNetV2's inverted residuals (1×1 expand,
  3×3 depthwise, 1×1 linear projection), where pruning a depthwise conv
  must follow the channels of the layer before it.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                  activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), activation(inplace=True))


class PlainVGG(nn.Module):
    """VGG-style CNN: conv-BN-ReLU stages separated by max pooling, then ``Linear``-BN-ReLU-``Linear``.

    Args:
        num_classes: classifier outputs.
        widths: channels of each stage (stages at 28, 14 and 7 pixels).
        depths: convolutions in each stage.
        hidden: width of the hidden classifier layer.
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = (16, 32, 64),
                 depths: tuple[int, ...] = (1, 1, 2), hidden: int = 128):
        super().__init__()
        layers, cin = [], 1
        for i, (width, depth) in enumerate(zip(widths, depths)):
            if i:
                layers.append(nn.MaxPool2d(2))
            for _ in range(depth):
                layers.append(_conv_bn_relu(cin, width))
                cin = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(cin, hidden, bias=False), nn.BatchNorm1d(hidden),
                                        nn.ReLU(inplace=True), nn.Dropout(0.2), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1×1 reduce, 3×3 (strided), 1×1 expand, each with BN; projected shortcut when needed."""

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(in_channels, mid_channels, 1),
                                  _conv_bn_relu(mid_channels, mid_channels, 3, stride),
                                  nn.Conv2d(mid_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class BottleneckResNet(nn.Module):
    """A deeper residual net: a stride-1 stem, then three stages of bottleneck blocks at 14, 7 and 4 pixels.

    Args:
        num_classes: classifier outputs.
        widths: bottleneck (middle) channels of each stage; a stage's output is ``expansion`` times wider.
        blocks: bottleneck blocks per stage.
        expansion: output channels over middle channels.
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = (8, 16, 32),
                 blocks: tuple[int, ...] = (2, 2, 2), expansion: int = 4):
        super().__init__()
        self.stem = _conv_bn_relu(1, 32)
        stages, cin = [], 32
        for width, count in zip(widths, blocks):
            cout = width * expansion
            stage = [Bottleneck(cin if i == 0 else cout, width, cout, 2 if i == 0 else 1) for i in range(count)]
            stages.append(nn.Sequential(*stage))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1×1 expand (ReLU6), 3×3 depthwise (ReLU6), 1×1 linear projection; residual when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand: int):
        super().__init__()
        hidden = in_channels * expand
        self.body = nn.Sequential(_conv_bn_relu(in_channels, hidden, 1, activation=nn.ReLU6),
                                  _conv_bn_relu(hidden, hidden, 3, stride, groups=hidden, activation=nn.ReLU6),
                                  nn.Conv2d(hidden, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


class MobileNetLike(nn.Module):
    """MobileNetV2-style net for 28×28 input: a conv stem, inverted residual stages, a 1×1 head conv.

    Args:
        num_classes: classifier outputs.
        stages: ``(out_channels, blocks, first_stride)`` per stage.
        stem: channels of the stem conv (at full resolution).
        expand: expansion factor of every inverted residual.
        head: channels of the last 1×1 conv.
    """

    def __init__(self, num_classes: int = 10,
                 stages: tuple[tuple[int, int, int], ...] = ((16, 1, 2), (24, 2, 2), (48, 2, 2)),
                 stem: int = 8, expand: int = 4, head: int = 128):
        super().__init__()
        self.stem = _conv_bn_relu(1, stem, activation=nn.ReLU6)
        blocks, cin = [], stem
        for cout, count, stride in stages:
            for i in range(count):
                blocks.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = _conv_bn_relu(cin, head, 1, activation=nn.ReLU6)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(head, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.head(self.blocks(self.stem(x)))), 1))
