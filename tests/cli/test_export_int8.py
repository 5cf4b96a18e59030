"""``optkit export MODEL --int8``: the ONNX file and its INT8 file appear together, verified, or neither does."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from optkit.analysis.latency import Latency
from optkit.cli import main
from optkit.demo import FASHION_RESNET
from optkit.io import models

ARCH = "optkit.demo.fashion_resnet:FashionResNet"
SHAPE = (1, 1, 28, 28)


@pytest.fixture
def no_timing(monkeypatch):
    """Every ONNX Runtime timing returns the same figures, so INT8 keeps every op group and nothing is timed.

    The choice of what stays FP32 is tested with injected timers in tests/passes/quantize; here the
    point is the command's files and checks, which are real.
    """
    def interleaved(paths, input_shape, **kwargs):
        return [Latency("onnxruntime", "cpu", input_shape[0], tuple(input_shape), 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1, 0,
                        1000.0) for _ in paths]

    monkeypatch.setattr("optkit.analysis.latency.interleaved_latency", interleaved)
    monkeypatch.setattr("optkit.passes.quantize.latency.interleaved_latency", interleaved)
    monkeypatch.setattr("optkit.passes.quantize.profile.node_times",
                        lambda path, reference, nodes, shape, **kwargs: {node: 1.0 for node in nodes})


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The demo model (trained on Fashion-MNIST) as a plain state_dict file, read back with ``--arch``."""
    path = tmp_path_factory.mktemp("weights") / "fashion.pt"
    torch.save(models.load(str(FASHION_RESNET)).model.state_dict(), path)
    return path


def _export(weights, onnx_path, *extra):
    args = ["export", weights, "--arch", ARCH, "--input-shape", "1,1,28,28", "--onnx", onnx_path, *extra]
    return CliRunner().invoke(main, [str(a) for a in args])


def _fashion_images(count: int) -> np.ndarray:
    from optkit.data import load_dataset

    dataset = load_dataset("fashion-mnist", "test", augment=False)
    return np.stack([dataset[i][0].numpy() for i in range(count)]).astype(np.float32)


def _outputs(path, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: images[i:i + 32]})[0] for i in range(0, len(images), 32)])


def test_export_int8_writes_the_onnx_file_and_a_verified_int8_file_beside_it(weights, tmp_path, no_timing):
    onnx_path = tmp_path / "fashion.onnx"
    result = _export(weights, onnx_path, "--int8", "--calib-data", "fashion-mnist")
    assert result.exit_code == 0, result.output
    int8_path = tmp_path / "fashion.int8.onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fashion.int8.onnx", "fashion.onnx"]
    assert "Wrote fashion.int8.onnx beside it" in result.output
    assert "agreement" in result.output and "accuracy" in result.output
    images = _fashion_images(256)
    model = models.load(str(FASHION_RESNET)).model.eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).numpy()
    fp32 = _outputs(onnx_path, images)
    np.testing.assert_allclose(fp32, expected, rtol=0, atol=1e-3 * np.abs(expected).max())
    int8 = _outputs(int8_path, images)
    assert (int8.argmax(1) == fp32.argmax(1)).mean() >= 0.97
    assert int8_path.stat().st_size < 0.4 * onnx_path.stat().st_size


def test_export_int8_refuses_to_overwrite_an_existing_int8_file(weights, tmp_path, no_timing):
    onnx_path = tmp_path / "fashion.onnx"
    int8_path = tmp_path / "fashion.int8.onnx"
    int8_path.write_bytes(b"keep")
    result = _export(weights, onnx_path, "--int8", "--calib-data", "fashion-mnist")
    assert result.exit_code == 1
    assert result.output == (f"Error: {int8_path} already exists; pass --force to overwrite it or choose another "
                             "--onnx path\n")
    assert int8_path.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fashion.int8.onnx"]


def test_a_refused_int8_model_leaves_the_folder_as_it_was(weights, tmp_path, no_timing):
    onnx_path = tmp_path / "fashion.onnx"
    onnx_path.write_bytes(b"earlier export")
    result = _export(weights, onnx_path, "--int8", "--force")
    assert result.exit_code == 1
    assert result.output.startswith("Error: INT8 quantization needs images") and result.output.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fashion.onnx"]
    assert onnx_path.read_bytes() == b"earlier export"


def test_int8_settings_without_int8_are_a_usage_error(weights, tmp_path):
    result = _export(weights, tmp_path / "fashion.onnx", "--calib-data", "fashion-mnist")
    assert result.exit_code == 2 and "--calib-data set INT8 quantization: add --int8" in result.output
    assert list(tmp_path.iterdir()) == []


def _optimize(*args):
    return CliRunner().invoke(main, ["optimize", str(FASHION_RESNET), *map(str, args)])


def test_optimize_export_onnx_int8_runs_and_writes_one_recipe_of_prune_export_int8(tmp_path, no_timing):
    first, second = tmp_path / "first", tmp_path / "second"
    result = _optimize("--prune", 0.3, "--export", "onnx", "--int8", "--calib-data", "fashion-mnist",
                       "--min-agreement", 0.97, "--out", first)
    assert result.exit_code == 0, result.output
    assert {"model.pt", "model.onnx", "model.int8.onnx", "recipe.toml"} <= {p.name for p in first.iterdir()}
    recipe = (first / "recipe.toml").read_text()
    assert [line for line in recipe.splitlines() if line.startswith("name = ")] == [
        'name = "structured_prune"', 'name = "export_onnx"', 'name = "int8"']
    assert 'calib_data = "fashion-mnist"' in recipe and "min_agreement = 0.97" in recipe
    assert torch.load(first / "model.pt", weights_only=True)["extra"]["recipe"] == recipe
    report = json.loads((first / "report.json").read_text())
    assert [p["name"] for p in report["passes"]] == ["structured_prune"]
    assert report["files"]["model.onnx"] == (first / "model.onnx").stat().st_size
    assert report["files"]["model.int8.onnx"] == (first / "model.int8.onnx").stat().st_size
    assert report["export"]["path"] == "model.onnx" and report["int8"]["path"] == "model.int8.onnx"
    assert report["int8"]["agreement"] >= 0.97
    assert any(note.startswith("model.int8.onnx: static INT8") for note in report["notes"])
    again = _optimize("--recipe", first / "recipe.toml", "--out", second)
    assert again.exit_code == 0, again.output
    assert (second / "recipe.toml").read_text() == recipe
    assert (second / "model.int8.onnx").exists()


def test_int8_without_export_is_a_one_line_error(tmp_path):
    result = _optimize("--prune", 0.3, "--int8", "--calib-data", "fashion-mnist", "--out", tmp_path / "o")
    assert result.exit_code == 1
    assert result.output == ("Error: command-line flags: step 2 (int8) takes an ONNX model, but the model is still "
                             "a PyTorch model there: add export_onnx (--export onnx) before it\n")
    assert not (tmp_path / "o").exists()
