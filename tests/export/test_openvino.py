"""optkit.export.openvino: IR written with the precision it was verified at (a plain OpenVINO reads it back), NNCF's
INT8 quantization, and both files published together."""

from __future__ import annotations

import numpy as np
import openvino
import pytest

from optkit.export import openvino as ir
from optkit.runtime import openvino as ov
from tests.support.tiny_onnx import tiny_cnn_onnx

SHAPE = (1, 3, 16, 16)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    return tiny_cnn_onnx(tmp_path_factory.mktemp("openvino") / "tiny.onnx", SHAPE)


def test_saved_ir_records_its_precision_and_a_plain_core_loads_it(onnx_file, tmp_path):
    size = ir.save(ov.read(onnx_file), tmp_path / "tiny.xml", "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.bin", "tiny.xml"]
    assert size == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert ov.recorded_precision(openvino.Core().read_model(str(tmp_path / "tiny.xml"))) == "bf16"
    assert ov.recorded_precision(ov.read(onnx_file)) is None
    compiled = openvino.Core().compile_model(str(tmp_path / "tiny.xml"), "CPU")
    assert compiled({0: np.zeros((3, 3, 16, 16), np.float32)})[0].shape == (3, 4)


def test_quantize_inserts_int8_fake_quantize_and_keeps_the_source(onnx_file):
    model = ov.read(onnx_file)
    batches = [np.random.default_rng(i).standard_normal((4, 3, 16, 16), dtype=np.float32) for i in range(2)]
    quantized = ir.quantize(model, batches)
    assert any(op.get_type_name() == "FakeQuantize" for op in quantized.get_ops())
    assert not any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())


def test_publish_moves_both_files_into_place(onnx_file, tmp_path):
    (tmp_path / "scratch").mkdir()
    ir.save(ov.read(onnx_file), tmp_path / "scratch" / "a.xml", "fp32")
    ir.publish(tmp_path / "scratch" / "a.xml", tmp_path / "model.xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "model.xml", "scratch"]
    assert list((tmp_path / "scratch").iterdir()) == []
    assert ov.recorded_precision(ov.read(tmp_path / "model.xml")) == "fp32"
