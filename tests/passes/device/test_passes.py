"""Tests for optkit/passes/device.py: ToDevice and ChannelsLast."""

from __future__ import annotations

import pytest
import torch
import torchvision

from optkit.io import checkpoint

from optkit.io import models
from optkit.core.errors import OptkitError
from optkit.passes import get_pass
from optkit.passes.device.passes import ChannelsLast, ToDevice, resolve_device

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def test_registered():
    assert get_pass("to_device") is ToDevice
    assert get_pass("channels_last") is ChannelsLast


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "", 3])
def test_rejects_malformed_device(bad):
    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N or mps"):
        ToDevice(device=bad)


def test_auto_resolves_to_an_available_device():
    device = resolve_device("auto")
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert device.type == expected
    assert resolve_device(None) == device


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_a_clear_error():
    with pytest.raises(OptkitError, match="no CUDA GPU is available; use --device cpu or auto"):
        ToDevice(device="cuda:1").apply(torch.nn.Linear(2, 2))


@requires_cuda
def test_cuda_index_out_of_range():
    with pytest.raises(OptkitError, match="CUDA GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("name", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_moves_parameters_and_buffers(name):
    model = torchvision.models.resnet18(num_classes=10)
    result = ToDevice(device=name).apply(model)
    assert result.model is model
    assert result.details["device"].startswith(name)
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.device.type == name for t in tensors)
    out = model.eval()(torch.randn(1, 3, 64, 64, device=name))
    assert out.shape == (1, 10)


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])
def test_channels_last_keeps_outputs_and_round_trips(arch, tmp_path):
    loaded = models.load(f"torchvision:{arch}", num_classes=10)
    model = loaded.model.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
    result = ChannelsLast().apply(model)
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert result.details["tensors_converted"] == len(convs)
    with torch.no_grad():
        after = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)

    path = tmp_path / "model.pt"
    checkpoint.save(model, path, loaded.arch)
    reloaded = models.load(str(path)).model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), before, rtol=1e-4, atol=1e-4)
