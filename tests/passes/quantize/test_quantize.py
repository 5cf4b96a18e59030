"""quantize_onnx end to end on a small trained CNN: reload, closeness to FP32, modes, and the op-speed rule."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from optkit.core.errors import ExportError
from optkit.export.onnx import export_onnx
from optkit.passes.quantize import Int8Settings, compare_latency, quantize_onnx

DATA = "synthetic:64:3x32x32:10"
SHAPE = (1, 3, 32, 32)
#: With 64 checking images one changed decision is 1.6 points: allow up to 3 (a ReLU CNN at 8 bits keeps nearly all).
AGREEMENT = 0.95
ACCURACY_DROP = 0.05
#: uint8 activations and int8 weights: a step of about 1/255 of each tensor's range over 4 layers.
RELATIVE_ERROR = 0.05


def _settings(**changes) -> Int8Settings:
    return Int8Settings(**{"calib_data": DATA, "measure_ops": False, "min_agreement": AGREEMENT,
                            "max_accuracy_drop": ACCURACY_DROP, **changes})


def _fp32_nodes(path) -> set[str]:
    """Conv/Gemm nodes that read no dequantized input: those that run in FP32."""
    graph = onnx.load(str(path)).graph
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in graph.node if n.op_type in ("Conv", "Gemm") and not any(i in dq for i in n.input)}


def _dequantized_inputs(path, op_type: str) -> bool:
    graph = onnx.load(str(path)).graph
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return any(i in dq for n in graph.node if n.op_type == op_type for i in n.input)


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_int8_reloads_close_to_fp32(models, out, run_onnx, val_images, method):
    result = quantize_onnx(models["plain"], out, _settings(calibration_method=method), input_shape=SHAPE)
    batches, labels = val_images
    fp32, int8 = run_onnx(models["plain"], batches), run_onnx(out, batches)
    relative = np.linalg.norm(int8 - fp32) / np.linalg.norm(fp32)
    agreement = np.mean(int8.argmax(1) == fp32.argmax(1))
    assert relative <= RELATIVE_ERROR and agreement >= AGREEMENT
    assert result.agreement == pytest.approx(agreement) and result.relative_error == pytest.approx(relative, rel=1e-3)
    assert result.accuracy_int8 == pytest.approx(np.mean(int8.argmax(1) == labels))
    assert _fp32_nodes(out) == set(result.excluded_nodes) and len(result.excluded_nodes) <= 1
    assert result.int8_size < 0.8 * result.fp32_size
    assert result.calibration_method == method and result.mode == "static"
    assert json.loads(json.dumps(result.to_dict()))["excluded_nodes"] == result.excluded_nodes


def test_random_calibration_says_so(models, out):
    result = quantize_onnx(models["plain"], out, Int8Settings(random_calibration=True, measure_ops=False,
                                                              min_agreement=0), input_shape=SHAPE)
    assert result.calibration == "random" and result.checked_on == "random"
    assert result.accuracy_fp32 is None and any("random calibration" in note for note in result.notes)


def test_dynamic_quantizes_linear_layers(tmp_path, out, run_onnx, val_images):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    fp32_path = tmp_path / "mlp.onnx"
    export_onnx(model, fp32_path, SHAPE)
    result = quantize_onnx(fp32_path, out, _settings(mode="dynamic", op_types=["MatMul", "Gemm"]), input_shape=SHAPE)
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "DynamicQuantizeLinear" in ops and ("MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops)
    batches, _ = val_images
    fp32, int8 = run_onnx(fp32_path, batches), run_onnx(out, batches)
    assert np.linalg.norm(int8 - fp32) / np.linalg.norm(fp32) <= RELATIVE_ERROR
    assert result.mode == "dynamic" and result.calibration is None and result.calibration_method is None


def _costs(paths):
    """A stand-in timer: 2 ms, 0.5 ms less when the convs run in INT8, 0.5 ms more when the Gemm does."""
    return [2.0 - 0.5 * _dequantized_inputs(p, "Conv") + 0.5 * _dequantized_inputs(p, "Gemm") for p in paths]


def _no_nodes(path):
    """A stand-in profiler that traces no node, so the per-node step has nothing to try."""
    return {}


def test_slow_op_groups_stay_fp32_and_are_cached(models, tmp_path, out):
    cache = tmp_path / "cache.json"
    settings = _settings(measure_ops=True)
    result = quantize_onnx(models["plain"], out, settings, input_shape=SHAPE, timer=_costs, profiler=_no_nodes,
                           cache_path=cache)
    assert list(result.op_gains) == ["Conv", "Gemm", "Relu", "all"], "heaviest group first, then all of them"
    assert result.op_gains["all"] == pytest.approx(1.5 / 2.0, abs=1e-3)
    assert result.op_gains["Conv"] == pytest.approx(2.0 / 1.5, abs=1e-3)
    assert result.op_gains["Gemm"] == pytest.approx(1.5 / 2.0, abs=1e-3)
    assert result.op_gains["Relu"] == pytest.approx(1.0, abs=1e-3)
    assert result.fp32_op_types == ["Gemm"] and not result.op_gains_cached
    assert not _dequantized_inputs(out, "Gemm") and _dequantized_inputs(out, "Conv")
    assert json.loads(cache.read_text())

    def no_timing(paths):
        raise AssertionError("the cached verdicts should have been used")

    again = quantize_onnx(models["plain"], out, settings, input_shape=SHAPE, timer=no_timing, cache_path=cache)
    assert again.op_gains_cached and again.fp32_op_types == ["Gemm"]


def test_groups_slower_alone_but_faster_together_are_all_int8(models, tmp_path, out):
    def together(paths):
        conv, gemm = (_dequantized_inputs(p, "Conv") for p in paths), (_dequantized_inputs(p, "Gemm") for p in paths)
        return [1.0 if c and g else 2.0 + c + g for c, g in zip(conv, gemm)]

    result = quantize_onnx(models["plain"], out, _settings(measure_ops=True), input_shape=SHAPE, timer=together,
                           profiler=_no_nodes, cache_path=tmp_path / "cache.json")
    assert result.fp32_op_types == [] and result.op_gains["all"] == pytest.approx(2.0, abs=1e-3)
    assert _dequantized_inputs(out, "Conv") and _dequantized_inputs(out, "Gemm")
    assert any("fully quantized model ran 2.00x faster" in note for note in result.notes)


def test_int8_slower_for_every_group_is_refused(models, tmp_path, out):
    def slower(paths):
        return [1.0 + _dequantized_inputs(p, "Conv") + _dequantized_inputs(p, "Gemm") + _dequantized_inputs(p, "Relu")
                for p in paths]

    with pytest.raises(ExportError, match="slower than FP32 here for every op group"):
        quantize_onnx(models["plain"], out, _settings(measure_ops=True), input_shape=SHAPE, timer=slower,
                      cache_path=tmp_path / "cache.json")
    assert list(out.parent.iterdir()) == []


def test_user_exclusions_stay_fp32(models, out):
    result = quantize_onnx(models["plain"], out, _settings(exclude=["/head/Gemm"]), input_shape=SHAPE)
    assert not _dequantized_inputs(out, "Gemm") and result.user_excluded == ["/head/Gemm"]


def test_unknown_exclusions_are_refused(models, out):
    with pytest.raises(ExportError, match="exclude names /nope/Conv, not a node"):
        quantize_onnx(models["plain"], out, _settings(exclude=["/nope/Conv"]), input_shape=SHAPE)
    assert not out.exists()


def test_latency_comparison_reports_both_models(models, out):
    quantize_onnx(models["plain"], out, _settings(), input_shape=SHAPE)
    report = compare_latency(models["plain"], out, SHAPE, batch_sizes=(1, 2), threads=(1,), warmup=0, repeats=1)
    assert [(r["batch_size"], r["threads"]) for r in report["runs"]] == [(1, 1), (2, 1)]
    assert all(r["fp32"]["repeats"] == 1 and r["int8"]["batch_size"] == r["batch_size"] for r in report["runs"])
    assert len(report["load_avg_1min"]) == 2


def test_missing_fp32_file_is_refused(tmp_path, out):
    with pytest.raises(ExportError, match="not found; export the model first"):
        quantize_onnx(tmp_path / "none.onnx", out, _settings(), input_shape=SHAPE)
