"""Small CNNs for the INT8 tests, exported with optkit's verified exporter, and fixtures that hold them."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from optkit.export.onnx import export_onnx

SHAPE = (1, 3, 32, 32)
DATA = "synthetic:64:3x32x32:10"
#: A weight this large sets its output channel's INT8 scale so coarse that every ordinary weight rounds to zero.
OUTLIER = 1000.0


class Chain(nn.Module):
    """Convs ``3 -> 8 -> 16 -> 16`` with ReLUs, global pooling and a classifier.

    ``sensitive`` holds the indices (1 or 2) of convs made hypersensitive to INT8: the conv before
    them has a dead last channel (zero weights and bias: exactly 0 in FP32 and INT8), and they weigh that channel by
    :data:`OUTLIER`, which changes nothing in FP32 but quantizes their other weights to zero.

    ``halves`` splits each activation's channels in halves and joins them again (as channel-split blocks do): the
    same function, but the exported graph computes the split sizes with int64 ``Add`` and ``Mul`` nodes.
    """

    def __init__(self, sensitive: tuple[int, ...] = (), *, trained: bool = True, halves: bool = False):
        super().__init__()
        self.halves = halves
        widths = [3, 8, 16, 16]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1)
                                   for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.head = nn.Linear(widths[-1], 10)
        if trained:
            self.load_state_dict(_trained())
        with torch.no_grad():
            for i in sensitive:
                before = self.convs[i - 1]
                before.weight[-1].zero_()
                before.bias[-1] = 0.0
                self.convs[i].weight[:, -1] = OUTLIER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
            if self.halves:
                x = torch.cat(x.chunk(2, dim=1), dim=1)
        return self.head(x.mean(dim=(2, 3)))


@functools.lru_cache(maxsize=1)
def _trained(steps: int = 40) -> dict[str, torch.Tensor]:
    """Weights after a few full-batch Adam steps on the synthetic data, so the model's top-1 depends on its input.

    A random-init model predicts nearly the same class for every image, and then top-1 agreement
    holds whatever INT8 does to it.
    """
    from optkit.data import load_dataset

    torch.manual_seed(0)
    model = Chain(trained=False)
    images, labels = zip(*load_dataset(DATA, "train", augment=False))
    x, y = torch.stack(images), torch.tensor(labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def exported(model: nn.Module, folder: Path, name: str = "fp32.onnx") -> Path:
    path = folder / name
    export_onnx(model.eval(), path, SHAPE)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """FP32 ONNX files: ``plain`` (no sensitive layer), ``one`` (convs.1 hypersensitive), ``two`` (convs.1 and 2),
    ``one_halves`` (``one`` splitting its channels in halves, see :class:`Chain`)."""
    folder = tmp_path_factory.mktemp("fp32")
    return {name: exported(Chain(sensitive, halves=halves), folder, f"{name}.onnx")
            for name, sensitive, halves in (("plain", (), False), ("one", (1,), False), ("two", (1, 2), False),
                                            ("one_halves", (1,), True))}


@pytest.fixture
def out(tmp_path) -> Path:
    """The INT8 destination, in a folder of its own so a test can check nothing else appears there."""
    folder = tmp_path / "out"
    folder.mkdir()
    return folder / "int8.onnx"


@pytest.fixture(scope="session")
def run_onnx():
    """``run_onnx(path, batches)``: the first output in a fresh default ONNX Runtime session (independent of optkit)."""
    import onnxruntime as ort

    def run(path: Path, batches: list[np.ndarray]) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return np.concatenate([session.run(None, {name: x})[0] for x in batches])

    return run


@pytest.fixture(scope="session")
def val_images() -> tuple[list[np.ndarray], np.ndarray]:
    """The 64 synthetic ``val`` images as float32 batches of 8, and their labels."""
    from optkit.data import load_dataset

    dataset = load_dataset(DATA, "val", augment=False)
    x = np.stack([dataset[i][0].numpy() for i in range(len(dataset))]).astype(np.float32)
    y = np.array([dataset[i][1] for i in range(len(dataset))])
    return [x[i:i + 8] for i in range(0, len(x), 8)], y
