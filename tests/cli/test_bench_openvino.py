"""``optkit bench`` in OpenVINO: an IR at the precision it records, an ONNX file or a model with --engine openvino,
--precision, and a comparison across runtimes (figures are checked for shape, never for speed)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.cli import main
from optkit.demo import FASHION_RESNET
from optkit.export import openvino as ir
from optkit.export.onnx import export_onnx
from optkit.runtime import openvino as ov

SHAPE = (1, 3, 16, 16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny CNN as ONNX (dynamic batch) and as an IR that records fp32."""
    folder = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    export_onnx(model.eval(), folder / "tiny.onnx", SHAPE)
    ir.save(ov.read(folder / "tiny.onnx"), folder / "tiny.xml", "fp32")
    return {"onnx": folder / "tiny.onnx", "xml": folder / "tiny.xml"}


def _bench(*args):
    result = CliRunner().invoke(main, ["bench", *map(str, args)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_an_ir_runs_in_openvino_at_the_precision_it_records(files):
    (run,) = _bench(files["xml"], "--threads", 1, "--warmup", 0, "--repeats", 2, "--json")["results"].values()
    assert [(r["engine"], r["precision"], r["input_shape"], r["threads"]) for r in run] == [
        ("openvino", "fp32", [1, 3, 16, 16], 1)]
    assert 0 < run[0]["min_ms"] <= run[0]["median_ms"] <= run[0]["max_ms"]


def test_an_onnx_file_runs_in_both_runtimes_at_each_batch(files):
    precision = "bf16" if ov.cpu_has_bf16() else "fp32"
    (run,) = _bench(files["onnx"], "--engine", "openvino", "--engine", "onnxruntime", "--precision", precision,
                    "--batch-size", 1, "--batch-size", 3, "--warmup", 0, "--repeats", 2, "--json")["results"].values()
    assert [(r["engine"], r["precision"], r["batch_size"]) for r in run] == [
        ("openvino", precision, 1), ("openvino", precision, 3), ("onnxruntime", None, 1), ("onnxruntime", None, 3)]


def test_compare_pairs_an_onnx_file_with_its_ir_by_batch(files):
    data = _bench("--compare", files["onnx"], files["xml"], "--warmup", 0, "--repeats", 2, "--json")
    (pair,) = data["compare"]["pairs"]
    assert pair["engine"] == "onnxruntime / openvino" and pair["batch_size"] == 1
    assert pair["speedup"] == pytest.approx(pair["a_median_ms"] / pair["b_median_ms"])


def test_a_model_is_exported_then_timed_in_openvino():
    (run,) = _bench(FASHION_RESNET, "--engine", "openvino", "--warmup", 0, "--repeats", 2, "--json")["results"].values()
    assert [(r["engine"], r["precision"], r["input_shape"]) for r in run] == [("openvino", "fp32", [1, 1, 28, 28])]


@pytest.mark.parametrize("args, message", [
    (["{xml}", "--engine", "onnxruntime"], "is an OpenVINO IR: it runs only with --engine openvino"),
    (["{onnx}", "--precision", "bf16"], "--precision sets OpenVINO's precision: add --engine openvino"),
])
def test_options_that_do_not_fit_openvino_are_usage_errors(files, args, message):
    result = CliRunner().invoke(main, ["bench", *(a.format(**files) for a in args)])
    assert result.exit_code == 2 and message in " ".join(result.output.split())
