"""The openvino and deploy passes in a pipeline: files beside model.onnx, the form they return, the report's figures,
and the unpruned model as the deploy baseline (timings are set, never measured)."""

from __future__ import annotations

import copy

import pytest

from optkit.core.context import RunContext
from optkit.core.errors import ExportError, PassError
from optkit.core.forms import OnnxModel
from optkit.core.pipeline import Pipeline
from optkit.passes.deploy import Deploy, OpenVino
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.prune.passes import StructuredPrune
from optkit.passes.quantize.passes import Int8

SHAPE = (1, 1, 28, 28)


def test_openvino_writes_the_ir_beside_model_onnx_and_returns_the_onnx_form(fashion_model, tmp_path, set_times):
    set_times({("onnxruntime", None): 2.0, ("openvino", "fp32"): 1.5})
    pipeline = Pipeline([ExportOnnx(), OpenVino(precision="fp32")], input_shape=SHAPE)
    run = pipeline.run(copy.deepcopy(fashion_model), context=RunContext(out_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "model.onnx", "model.xml"]
    assert isinstance(run.model, OnnxModel) and run.model.path == tmp_path / "model.onnx"
    assert run.model.precision == "fp32"
    details = run.records[-1].details
    assert details["path"] == "model.xml" and set(details["files"]) == {"model.xml", "model.bin"}
    assert details["latency_rows"] == [{"label": f"OpenVINO fp32 vs ONNX Runtime FP32 ms "
                                                 f"({details['latency']['threads']} thr, batch 1)",
                                        "before_ms": 2.0, "after_ms": 1.5}]
    assert details["notes"][0].startswith("model.xml: OpenVINO fp32 (compile with INFERENCE_PRECISION_HINT f32)")


def test_openvino_then_int8_still_quantizes_the_fp32_file(fashion_model, fashion_data, tmp_path, set_times):
    set_times({})
    steps = [ExportOnnx(), OpenVino(precision="fp32"),
             Int8(calib_data=fashion_data, min_agreement=0.97, measure_ops=False)]
    run = Pipeline(steps, input_shape=SHAPE).run(copy.deepcopy(fashion_model), context=RunContext(out_dir=tmp_path))
    assert run.model.path.name == "model.int8.onnx" and (tmp_path / "model.xml").is_file()


def test_deploy_times_against_the_model_before_the_pipeline(fashion_model, fashion_data, tmp_path, set_times):
    calls = set_times({("onnxruntime", None): 10.0, ("onnxruntime", "fp32"): 6.0, ("onnxruntime", "int8"): 3.0})
    steps = [StructuredPrune(ratio=0.25, round_to=2), ExportOnnx(),
             Deploy(calib_data=fashion_data, candidates=("onnxruntime-fp32", "onnxruntime-int8"), min_agreement=0.97)]
    run = Pipeline(steps, input_shape=SHAPE).run(copy.deepcopy(fashion_model), context=RunContext(out_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.int8.onnx", "model.onnx"]
    assert run.model.path.name == "model.int8.onnx" and run.model.precision == "int8"
    (baseline, baseline_size), (pruned, pruned_size) = calls[-1][:2]
    assert baseline.path.name == "unpruned.onnx" and pruned.path == tmp_path / "model.onnx"
    assert pruned_size < 0.8 * baseline_size
    details = run.records[-1].details
    assert details["label"] == "ONNX Runtime INT8" and details["speedup"] == pytest.approx(10 / 3, abs=1e-3)
    assert details["latency_rows"][0]["label"].startswith("ONNX Runtime INT8 ms vs unpruned ONNX Runtime FP32")


def test_deploy_refuses_a_model_an_int8_step_already_quantized(fashion_onnx):
    with pytest.raises(ExportError, match="deploy starts from the FP32 ONNX model.*drop --int8"):
        Deploy().apply(OnnxModel(fashion_onnx, SHAPE, None, "int8"))


def test_deploy_refuses_to_overwrite_a_file_an_earlier_step_wrote(fashion_model, tmp_path, set_times):
    set_times({})
    steps = [ExportOnnx(), OpenVino(precision="fp32"), Deploy()]
    with pytest.raises(PassError, match="pass 'deploy' failed.*model.xml was written by an earlier step"):
        Pipeline(steps, input_shape=SHAPE).run(copy.deepcopy(fashion_model), context=RunContext(out_dir=tmp_path))
