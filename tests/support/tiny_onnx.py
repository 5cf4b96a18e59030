"""A tiny CNN exported to ONNX, for tests of what reads, compiles and writes files."""

from pathlib import Path

import torch
from torch import nn

from optkit.export.onnx import export_onnx


def tiny_cnn_onnx(path: Path, shape: tuple[int, ...]) -> Path:
    """Export a seeded 3-channel CNN with 4 outputs to ``path`` (dynamic batch) at ``shape``; returns ``path``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    export_onnx(model.eval(), path, shape)
    return path
