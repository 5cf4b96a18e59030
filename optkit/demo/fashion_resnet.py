"""A small ResNet for 28×28 grayscale images (Fashion-MNIST), the accuracy benchmark's baseline.

Three stages of one basic block each (32, 64, 128 channels at 14×14, 7×7 and
4×4) after a 3×3 stem at full resolution: about 10 M MACs per image, small
enough to train on two CPU cores, wide enough to prune.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with a residual connection (1×1 conv-BN when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class FashionResNet(nn.Module):
    """ResNet-style classifier for 1×28×28 inputs.

    Args:
        num_classes: classifier outputs.
        widths: channels of the stem/first stage, second and third stage.
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (32, 64, 128)):
        super().__init__()
        w1, w2, w3 = widths
        self.stem = nn.Sequential(nn.Conv2d(1, w1, 3, 1, 1, bias=False), nn.BatchNorm2d(w1), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(w1, w1, 2)
        self.layer2 = BasicBlock(w1, w2, 2)
        self.layer3 = BasicBlock(w2, w3, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))
