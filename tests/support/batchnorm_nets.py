"""BatchNorm test models and helpers: models whose data flow module order does not tell, and output checks."""

import torch
import torchvision
from torch import nn

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class BranchConcatCNN(nn.Module):
    """Two conv branches concatenated, a functional ReLU and a residual add: module order says nothing."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.right = nn.Conv2d(8, 8, 1)
        self.merge = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.cat([torch.relu(self.left(x)), self.right(x) + x], dim=1)
        x = torch.relu(self.merge(x))
        return self.head(x.mean(dim=(2, 3)))


class DataDependent(nn.Module):
    """torch.fx cannot trace this (``if`` on a tensor value), so the autograd-graph fallback is used."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        if x.mean() > -1:  # always true; only its data dependence matters
            y = self.conv2(x)
            x = self.bn2(y) + y  # conv2 also feeds the add: bn2 cannot be folded
        x = torch.relu(self.conv3(x))
        return self.head(x.mean(dim=(2, 3)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative difference of ``a`` from ``b``."""
    return float((a - b).norm() / b.norm())


def eval_out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model``'s eval-mode output on ``x``."""
    model.eval()
    with torch.no_grad():
        return model(x)


def randomize_bn(model: nn.Module) -> None:
    """Random running statistics and affine parameters for every BatchNorm, so folding them changes weights."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BNS):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) - 0.5)


def build(name: str) -> nn.Module:
    """``branch_concat`` (:class:`BranchConcatCNN`) or a torchvision model with 10 classes, seeded."""
    if name == "branch_concat":
        torch.manual_seed(0)
        return BranchConcatCNN()
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, num_classes=10)
