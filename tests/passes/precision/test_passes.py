"""Tests for optkit/passes/precision.py and optkit/amp.py: the autocast wrap."""

from __future__ import annotations

import onnx
import pytest
import torch
import torchvision

from optkit.passes.precision import autocast as amp

from optkit.io import checkpoint

from optkit.io import models
from optkit.passes import get_pass
from optkit.passes.precision.passes import Autocast

# bf16 keeps 8 bits of mantissa: relative error per op ~0.4%, a few % over a network.
BF16_RTOL = 0.05


def _loaded(arch: str = "resnet18"):
    loaded = models.load(f"torchvision:{arch}", num_classes=10)
    loaded.model.eval()
    return loaded


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_registered_and_validated():
    assert get_pass("autocast") is Autocast
    with pytest.raises(ValueError, match="auto, bf16, fp16, off"):
        Autocast(dtype="int8")


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])
def test_bf16_outputs_match_fp32_within_bf16_tolerance(arch):
    model = _loaded(arch).model
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        result = Autocast(dtype="bf16").apply(model)
        out = result.model(x)
    assert isinstance(result.model, amp.AutocastModule)
    assert result.details["dtype"] == "bf16"
    assert out.dtype == torch.float32
    assert _relative_error(out, expected) < BF16_RTOL


def test_off_returns_the_model_unwrapped():
    model = _loaded().model
    result = Autocast(dtype="off").apply(model)
    assert result.model is model
    assert result.details["dtype"] == "off"


def test_rewrapping_does_not_nest():
    model = _loaded().model
    once = Autocast(dtype="bf16")(model)
    twice = Autocast(dtype="fp16")(once)
    assert isinstance(twice, amp.AutocastModule) and twice.model is model and twice.dtype == "fp16"


def test_auto_on_cpu_follows_capability_and_measurement(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: False)
    assert amp.resolve_amp("auto", cpu, measure=lambda d: 1.0)[0] == "off"
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: True)
    faster = {None: 2.0, "bf16": 1.0}
    choice, facts = amp.resolve_amp("auto", cpu, measure=faster.get)
    assert choice == "bf16" and facts["bf16_speedup"] == 2.0
    slower = {None: 1.0, "bf16": 1.5}
    assert amp.resolve_amp("auto", cpu, measure=slower.get)[0] == "off"
    assert amp.resolve_amp("auto", torch.device("cuda"))[0] == "fp16"
    assert amp.resolve_amp("bf16", cpu)[0] == "bf16"


def test_auto_pass_records_its_decision():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 16 * 16, 10))
    result = Autocast(dtype="auto", input_shape=(4, 3, 16, 16)).apply(model)
    assert result.details["dtype"] in ("bf16", "off")
    assert (result.details["dtype"] == "bf16") == isinstance(result.model, amp.AutocastModule)
    if amp.cpu_has_native_bf16() and not torch.cuda.is_available():
        assert result.details["fp32_forward_ms"] > 0 and result.details["bf16_forward_ms"] > 0
    assert model.training


def test_structured_outputs_become_fp32():
    out = amp._to_float32({"a": torch.ones(1, dtype=torch.bfloat16), "b": (torch.ones(1, dtype=torch.half), 3),
                           "i": torch.ones(1, dtype=torch.long)})
    assert out["a"].dtype == torch.float32 and out["b"][0].dtype == torch.float32 and out["b"][1] == 3
    assert out["i"].dtype == torch.long


def test_checkpoint_round_trip_sees_through_the_wrapper(tmp_path):
    loaded = _loaded()
    wrapped = Autocast(dtype="bf16")(loaded.model)
    path = tmp_path / "model.pt"
    checkpoint.save(wrapped, path, loaded.arch)
    saved = torch.load(path, weights_only=True)
    assert not any(k.startswith("model.") for k in saved["state_dict"])
    reloaded = models.load(str(path)).model.eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), loaded.model(x), rtol=0, atol=0)


def test_onnx_export_of_the_unwrapped_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 14 * 14, 5)).eval()
    x = torch.randn(1, 3, 16, 16)
    wrapped = Autocast(dtype="bf16")(model)
    inner = checkpoint.unwrap(wrapped)
    assert inner is model
    path = tmp_path / "model.onnx"
    torch.onnx.export(inner, (x,), str(path))
    graph = onnx.load(str(path))
    onnx.checker.check_model(graph)
    weight_types = {init.data_type for init in graph.graph.initializer if len(init.dims) > 1}
    assert weight_types == {onnx.TensorProto.FLOAT}
