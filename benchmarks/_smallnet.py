"""A ResNet-18-style network for 28x28 images (used by the throughput benchmark).

Its residual block is the accuracy benchmark's (``optkit.demo.fashion_resnet.BasicBlock``).
"""

from __future__ import annotations

from optkit.demo.fashion_resnet import BasicBlock
from torch import nn


class SmallResNet18(nn.Module):
    """ResNet-18's layout (4 stages of 2 basic blocks) with a 3x3 stem for 28x28 inputs.

    Args:
        in_channels: image channels.
        num_classes: classifier outputs.
        width: channels of the first stage; stages double it (64 is ResNet-18's width).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        stages, cin = [], width
        for i in range(4):
            cout = width * 2 ** i
            stages += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))
