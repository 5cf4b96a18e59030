"""Latency follows the runtime: interleaved timing of ONNX Runtime and OpenVINO deployments, the same inputs in
both, and comparisons across runtimes (figures are checked for shape, never for speed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from optkit.analysis import latency
from optkit.core.errors import OptkitError
from optkit.export import openvino as ir
from optkit.export.onnx import export_onnx
from optkit.runtime import onnxrt
from optkit.runtime import openvino as ov

SHAPE = (2, 3, 16, 16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny CNN as ONNX (dynamic and fixed batch) and as an IR recording fp32."""
    folder = tmp_path_factory.mktemp("runtimes")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    export_onnx(model.eval(), folder / "tiny.onnx", SHAPE)
    export_onnx(model.eval(), folder / "fixed.onnx", SHAPE, dynamic_batch=False)
    ir.save(ov.read(folder / "tiny.onnx"), folder / "tiny.xml", "fp32")
    return {"onnx": folder / "tiny.onnx", "fixed": folder / "fixed.onnx", "xml": folder / "tiny.xml"}


def test_interleaved_timing_runs_each_file_in_its_runtime(files):
    precision = "bf16" if ov.cpu_has_bf16() else "fp32"
    targets = [files["onnx"], files["xml"], latency.Deployment(files["onnx"], "openvino", precision)]
    results = latency.interleaved_latency(targets, SHAPE, threads=1, warmup=0, repeats=3)
    assert [(r.engine, r.precision, r.input_shape, r.repeats) for r in results] == [
        ("onnxruntime", None, SHAPE, 4), ("openvino", None, SHAPE, 4), ("openvino", precision, SHAPE, 4)]
    assert all(0 < r.min_ms <= r.median_ms <= r.max_ms for r in results)


def test_both_runtimes_get_the_same_inputs_and_agree(files):
    session = onnxrt.onnx_session(files["onnx"], 1)
    compiled = ov.compile_model(files["xml"], threads=1, input_shape=SHAPE)
    onnx_inputs, openvino_inputs = onnxrt.onnx_feed(session, SHAPE, seed=3), ov.openvino_feed(compiled, SHAPE, seed=3)
    np.testing.assert_array_equal(next(iter(onnx_inputs.values())), openvino_inputs[0])
    expected = session.run(None, onnx_inputs)[0]
    np.testing.assert_allclose(compiled(openvino_inputs)[0], expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_bench_openvino_times_each_batch_and_refuses_one_a_fixed_file_cannot_take(files):
    results = latency.bench_openvino(files["onnx"], batch_sizes=[1, 3], threads=1, warmup=0, repeats=2)
    assert [(r.engine, r.precision, r.input_shape) for r in results] == [
        ("openvino", "fp32", (1, 3, 16, 16)), ("openvino", "fp32", (3, 3, 16, 16))]
    with pytest.raises(OptkitError, match="fixed batch of 2; it cannot run batch 3"):
        latency.bench_openvino(files["fixed"], batch_sizes=[3], warmup=0, repeats=1)


def _timing(engine: str, batch: int, median: float, spread: float = 1.05) -> latency.Latency:
    return latency.Latency(engine, "cpu", batch, (batch, 3), 1, median, median * spread, median, median * spread,
                           spread, 5, 1, batch * 1000 / median)


def test_compare_pairs_two_runtimes_by_batch_only_when_each_side_has_one():
    a = [_timing("onnxruntime", 1, 4.0), _timing("onnxruntime", 8, 20.0)]
    b = [_timing("openvino", 1, 2.0), _timing("openvino", 8, 16.0)]
    pairs = latency.compare(a, b)
    assert [(p["engine"], p["batch_size"], p["speedup"], p["noisy"]) for p in pairs] == [
        ("onnxruntime / openvino", 1, 2.0, False), ("onnxruntime / openvino", 8, 1.25, False)]
    mixed = latency.compare(a + [_timing("torch", 1, 9.0)], b)
    assert mixed == []
