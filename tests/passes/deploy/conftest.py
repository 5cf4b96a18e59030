"""The trained Fashion-MNIST demo model exported once, a model bf16 cannot run, and a timer that returns set figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from optkit.analysis.latency import Latency
from optkit.demo import FASHION_RESNET
from optkit.export.onnx import export_onnx
from optkit.io import models

SHAPE = (1, 1, 28, 28)
DATA = "fashion-mnist"


@pytest.fixture(scope="session")
def fashion_data() -> str:
    """The Fashion-MNIST spec; the test is skipped without Debian's dataset-fashion-mnist."""
    from optkit.core.errors import DataError
    from optkit.data import check_available

    try:
        check_available(DATA)
    except DataError as e:
        pytest.skip(f"Fashion-MNIST is not installed ({e})")
    return DATA


@pytest.fixture(scope="session")
def fashion_model():
    """The demo model (92.4% Fashion-MNIST test accuracy), in eval mode."""
    return models.load(str(FASHION_RESNET)).model.eval()


@pytest.fixture(scope="session")
def fashion_onnx(fashion_model, tmp_path_factory) -> Path:
    """The demo model exported by optkit's verified exporter (read-only: tests copy it where they write)."""
    path = tmp_path_factory.mktemp("fashion") / "model.onnx"
    export_onnx(fashion_model, path, SHAPE)
    return path


@pytest.fixture
def onnx_copy(fashion_onnx, tmp_path) -> Path:
    """The exported demo model alone in a fresh folder, as a run's output folder would hold it."""
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "model.onnx"
    path.write_bytes(fashion_onnx.read_bytes())
    return path


@pytest.fixture(scope="session")
def test_images(fashion_data) -> tuple[np.ndarray, np.ndarray]:
    """The first 512 Fashion-MNIST test images (never used by calibration or the checks) and their labels."""
    from optkit.data import load_dataset

    dataset = load_dataset(fashion_data, "test", augment=False)
    images = np.stack([dataset[i][0].numpy() for i in range(512)]).astype(np.float32)
    return images, np.array([dataset[i][1] for i in range(512)])


class Offset(nn.Module):
    """A classifier whose first conv adds 1000 to every feature and whose second takes it off again.

    FP32 keeps the input's part (about 1) of each feature; bf16 (8 significant bits: a step of 4 at 1000)
    rounds it away, so its top-1 class no longer follows the input.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 16, 1), nn.Linear(16, 10)
        with torch.no_grad():
            self.a.bias.fill_(1000.0)
            self.b.weight.copy_(torch.eye(16).view(16, 16, 1, 1))
            self.b.bias.fill_(-1000.0)
            self.head.weight.mul_(10.0)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.a(x))).mean(dim=(2, 3)))


@pytest.fixture
def offset_onnx(tmp_path) -> Path:
    """:class:`Offset` exported alone in a fresh folder: its bf16 model misses any agreement check."""
    folder = tmp_path / "offset"
    folder.mkdir()
    export_onnx(Offset().eval(), folder / "model.onnx", SHAPE)
    return folder / "model.onnx"


def fake_latency(runtime: str, precision: str | None, median_ms: float) -> Latency:
    return Latency(runtime, "cpu", 1, SHAPE, 1, median_ms, median_ms, median_ms, median_ms, 1.0, 20, 3,
                   1000.0 / median_ms, precision)


@pytest.fixture
def timed_here(monkeypatch):
    """Timings meant for a fresh process (the latency budget's baseline) run in this one, through its timers."""
    from optkit.analysis.fresh import call_here

    monkeypatch.setattr("optkit.analysis.fresh.call_fresh", call_here)


@pytest.fixture
def set_times(monkeypatch, timed_here):
    """``set_times({(runtime, precision): ms})``: every interleaved timing returns those medians (1 ms when not
    given), nothing is timed; it returns the list of calls, each ``[(Deployment, file size), ...]``.

    The baseline (a plain FP32 file) is ``("onnxruntime", None)``. ONNX Runtime INT8's own op-speed checks
    get equal times, so it keeps every op group. Timings meant for a fresh process get them too.
    """
    def install(medians: dict[tuple[str, str | None], float]) -> list[list]:
        calls: list[list] = []

        def interleaved(paths, input_shape, **kwargs):
            from optkit.analysis.latency import as_deployment

            targets = [as_deployment(p) for p in paths]
            calls.append([(t, Path(t.path).stat().st_size) for t in targets])
            return [fake_latency(t.runtime, t.precision, medians.get((t.runtime, t.precision), 1.0)) for t in targets]

        monkeypatch.setattr("optkit.analysis.latency.interleaved_latency", interleaved)
        monkeypatch.setattr("optkit.passes.quantize.latency.interleaved_latency", interleaved)
        monkeypatch.setattr("optkit.passes.quantize.profile.node_times",
                            lambda path, reference, nodes, shape, **kwargs: {node: 1.0 for node in nodes})
        return calls

    return install
