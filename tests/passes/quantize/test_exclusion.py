"""The exclusion search leaves exactly the hypersensitive layers in FP32, worst first."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from optkit.core.errors import ExportError
from optkit.passes.quantize import Int8Settings, quantize_onnx

SHAPE = (1, 3, 32, 32)
#: With 64 checking images one changed decision is 1.6 points of agreement and of accuracy: allow up to 3.
SETTINGS = dict(calib_data="synthetic:64:3x32x32:10", measure_ops=False, min_agreement=0.95, max_accuracy_drop=0.05)


def _fp32_convs(path) -> set[str]:
    graph = onnx.load(str(path)).graph
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in graph.node if n.op_type in ("Conv", "Gemm") and not any(i in dq for i in n.input)}


def test_search_excludes_exactly_the_sensitive_conv(models, out, run_onnx, val_images):
    result = quantize_onnx(models["one"], out, Int8Settings(**SETTINGS), input_shape=SHAPE)
    assert result.excluded_nodes == ["/convs.1/Conv"]
    assert _fp32_convs(out) == {"/convs.1/Conv"}
    assert result.search[0]["node"] == "/convs.1/Conv" and result.search[0]["agreement"] >= 0.95
    batches, _ = val_images
    fp32, int8 = run_onnx(models["one"], batches), run_onnx(out, batches)
    assert np.mean(fp32.argmax(1) == int8.argmax(1)) >= 0.95
    assert any("/convs.1/Conv" in note for note in result.notes)


def test_search_takes_the_worst_first_when_two_layers_are_sensitive(models, out):
    result = quantize_onnx(models["two"], out, Int8Settings(**SETTINGS), input_shape=SHAPE)
    assert result.excluded_nodes == ["/convs.1/Conv", "/convs.2/Conv"]
    assert _fp32_convs(out) == {"/convs.1/Conv", "/convs.2/Conv"}


def test_shape_arithmetic_is_neither_timed_nor_scored_and_the_search_still_finds_the_sensitive_conv(models, out):
    import onnx

    from optkit.passes.quantize.optypes import op_groups

    graph = onnx.load(str(models["one_halves"])).graph
    shape_nodes = {n.name for n in graph.node if n.op_type in ("Add", "Mul")}
    assert shape_nodes, "the channel split exported no shape arithmetic: the test checks nothing"
    grouped = {name for names in op_groups(models["one_halves"], ("Conv", "Add", "Mul")).values() for name in names}
    assert not grouped & shape_nodes and {"/convs.0/Conv", "/convs.1/Conv", "/convs.2/Conv"} <= grouped
    result = quantize_onnx(models["one_halves"], out, Int8Settings(**SETTINGS), input_shape=SHAPE)
    assert result.excluded_nodes == ["/convs.1/Conv"]
    assert _fp32_convs(out) == {"/convs.1/Conv"}


def test_without_auto_exclude_the_sensitive_model_is_refused(models, out):
    with pytest.raises(ExportError, match="top-1 agreement"):
        quantize_onnx(models["one"], out, Int8Settings(**SETTINGS, auto_exclude=False), input_shape=SHAPE)
    assert not out.exists()
