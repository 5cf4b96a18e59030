"""optkit.runtime.openvino: a file compiled at an explicit precision (read back from the IR), NNCF imported with its
telemetry off, and a clear one-line answer when OpenVINO is missing."""

from __future__ import annotations

import subprocess
import sys

import openvino
import pytest

from optkit.core.errors import ExportError
from optkit.runtime import openvino as ov
from tests.support.tiny_onnx import tiny_cnn_onnx

SHAPE = (1, 3, 16, 16)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    return tiny_cnn_onnx(tmp_path_factory.mktemp("openvino") / "tiny.onnx", SHAPE)


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


def test_nncf_is_imported_with_its_telemetry_off():
    # In a fresh interpreter without pytest, which NNCF itself treats as a reason to stay quiet.
    code = ("import os\nfrom optkit.runtime import openvino as ov\nov.nncf_module()\n"
            "from nncf.telemetry.wrapper import NNCFTelemetryStub, telemetry\n"
            "print(isinstance(telemetry, NNCFTelemetryStub), 'NNCF_CI' in os.environ)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_without_openvino_everything_says_how_to_install_it(onnx_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    assert not ov.available() and ov.missing_note() == ov.MISSING_NOTE
    assert ov.unavailable("fp32") == "OpenVINO is not installed (pip install -e '.[openvino]')"
    with pytest.raises(ExportError, match=r"^OpenVINO is not installed; pip install -e '\.\[openvino\]' to deploy"):
        ov.read(onnx_file)
