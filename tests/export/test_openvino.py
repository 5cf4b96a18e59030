"""optkit.export.openvino: IR written and read back with its precision, compiled at an explicit precision, NNCF
imported with its telemetry off, and a clear one-line answer when OpenVINO is missing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import openvino
import pytest
import torch
from torch import nn

from optkit.core.errors import ExportError
from optkit.export import openvino as ov
from optkit.export.onnx import export_onnx

SHAPE = (1, 3, 16, 16)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    path = tmp_path_factory.mktemp("openvino") / "tiny.onnx"
    export_onnx(model.eval(), path, SHAPE)
    return path


def test_saved_ir_records_its_precision_and_a_plain_core_loads_it(onnx_file, tmp_path):
    size = ov.save(ov.read(onnx_file), tmp_path / "tiny.xml", "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.bin", "tiny.xml"]
    assert size == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert ov.recorded_precision(openvino.Core().read_model(str(tmp_path / "tiny.xml"))) == "bf16"
    assert ov.recorded_precision(ov.read(onnx_file)) is None
    compiled = openvino.Core().compile_model(str(tmp_path / "tiny.xml"), "CPU")
    assert compiled({0: np.zeros((3, 3, 16, 16), np.float32)})[0].shape == (3, 4)


def test_fp32_sets_the_f32_hint_explicitly(onnx_file):
    compiled = ov.compile_model(onnx_file, precision="fp32", threads=1, input_shape=(2, 3, 16, 16))
    assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) == str(openvino.Type.f32)
    assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert list(compiled.inputs[0].get_shape()) == [2, 3, 16, 16]


@pytest.mark.skipif(not ov.cpu_has_bf16(), reason="this CPU has no bf16 instructions")
def test_bf16_and_int8_compute_in_bf16_where_the_cpu_has_it(onnx_file):
    for precision in ("bf16", "int8"):
        compiled = ov.compile_model(onnx_file, precision=precision)
        assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) == str(openvino.Type.bf16)


def test_a_cpu_without_bf16_refuses_bf16_and_runs_int8_in_f32(onnx_file, monkeypatch):
    monkeypatch.setattr(ov, "cpu_has_bf16", lambda: False)
    assert ov.compute_hint("int8") == "f32"
    with pytest.raises(ExportError, match="OpenVINO bf16 cannot run here: this CPU has no bf16 instructions"):
        ov.compile_model(onnx_file, precision="bf16")
    with pytest.raises(ValueError, match="must be one of fp32, bf16, int8"):
        ov.unavailable("fp16")


def test_quantize_inserts_int8_fake_quantize_and_keeps_the_source(onnx_file):
    model = ov.read(onnx_file)
    batches = [np.random.default_rng(i).standard_normal((4, 3, 16, 16), dtype=np.float32) for i in range(2)]
    quantized = ov.quantize(model, batches)
    assert any(op.get_type_name() == "FakeQuantize" for op in quantized.get_ops())
    assert not any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())


def test_publish_moves_both_files_into_place(onnx_file, tmp_path):
    (tmp_path / "scratch").mkdir()
    ov.save(ov.read(onnx_file), tmp_path / "scratch" / "a.xml", "fp32")
    ov.publish(tmp_path / "scratch" / "a.xml", tmp_path / "model.xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "model.xml", "scratch"]
    assert list((tmp_path / "scratch").iterdir()) == []
    assert ov.recorded_precision(ov.read(tmp_path / "model.xml")) == "fp32"


def test_nncf_is_imported_with_its_telemetry_off():
    # In a fresh interpreter without pytest, which NNCF itself treats as a reason to stay quiet.
    code = ("import os\nfrom optkit.export import openvino as ov\nov._nncf()\n"
            "from nncf.telemetry.wrapper import NNCFTelemetryStub, telemetry\n"
            "print(isinstance(telemetry, NNCFTelemetryStub), 'NNCF_CI' in os.environ)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_without_openvino_everything_says_how_to_install_it(onnx_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    assert not ov.available() and ov.missing_note() == ov.MISSING_NOTE
    assert ov.unavailable("fp32") == "OpenVINO is not installed (pip install 'optkit[openvino]')"
    with pytest.raises(ExportError, match=r"^OpenVINO is not installed; pip install 'optkit\[openvino\]' to deploy"):
        ov.read(onnx_file)
