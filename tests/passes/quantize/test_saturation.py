"""int8_can_saturate: 7-bit weights exactly on x86-64 CPUs without VNNI, read from the CPU's flags."""

from __future__ import annotations

import pytest

from optkit.passes.quantize import static

CAN_SATURATE = static.int8_can_saturate


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    CAN_SATURATE.cache_clear()
    monkeypatch.setattr(static.platform, "machine", lambda: "x86_64")
    yield
    CAN_SATURATE.cache_clear()


@pytest.mark.parametrize("flags, saturates", [
    ("fpu sse2 avx avx2 fma", True),
    ("fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16", False),
    ("fpu avx2 avx_vnni", False),
    ("fpu avx2 avx512f avx512_vnnix", True),
])
def test_only_vnni_flags_avoid_the_reduced_range(tmp_path, flags, saturates):
    assert static.int8_can_saturate(_cpuinfo(tmp_path, flags)) is saturates


def test_unreadable_flags_on_x86_count_as_saturating_and_other_architectures_never_do(tmp_path, monkeypatch):
    assert static.int8_can_saturate(str(tmp_path / "missing")) is True
    static.int8_can_saturate.cache_clear()
    monkeypatch.setattr(static.platform, "machine", lambda: "aarch64")
    assert static.int8_can_saturate(_cpuinfo(tmp_path, "fp asimd")) is False


@pytest.mark.parametrize("saturates", [True, False])
def test_the_weights_use_7_bits_exactly_when_the_cpu_can_saturate_and_the_result_says_so(tmp_path, monkeypatch,
                                                                                          saturates):
    onnx = pytest.importorskip("onnx")
    torch = pytest.importorskip("torch")
    from onnx import numpy_helper

    from optkit.export.onnx import export_onnx
    from optkit.passes.quantize import Int8Settings, quantize_onnx

    monkeypatch.setattr(static, "int8_can_saturate", lambda: saturates)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).eval()
    shape = (1, 3, 4, 4)
    export_onnx(model, tmp_path / "m.onnx", shape)
    settings = Int8Settings(mode="dynamic", op_types=("MatMul", "Gemm"), random_calibration=True, min_agreement=0.0,
                            auto_exclude=False, measure_ops=False)
    result = quantize_onnx(tmp_path / "m.onnx", tmp_path / "m.int8.onnx", settings, input_shape=shape)
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "m.int8.onnx")).graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and t.dims and len(t.dims) == 2]
    assert len(weights) == 2
    largest = max(int(abs(w.astype(int)).max()) for w in weights)
    assert largest == (64 if saturates else 127)
    assert (static.REDUCED_RANGE_NOTE in result.notes) is saturates
