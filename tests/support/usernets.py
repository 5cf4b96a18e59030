"""Model classes that stand in for a user's own package in tests."""

import torch
from torch import nn


class BranchyNet(nn.Module):
    """A small custom CNN with a residual add and a concatenation (not from torchvision)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.left = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.right = nn.Sequential(nn.Conv2d(16, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.merge = nn.Conv2d(24, 32, 3, padding=1, stride=2)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([self.left(x) + x, self.right(x)], dim=1)
        x = self.merge(x).relu().mean(dim=(2, 3))
        return self.head(x)


class GrayNet(nn.Module):
    """A grayscale 28x28 classifier whose linear head fits that size only (as many user models do)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
