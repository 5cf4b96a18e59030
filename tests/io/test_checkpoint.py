import pytest
import torch
import torchvision
from torch import nn

from optkit.io import checkpoint
from optkit.core.errors import ModelLoadError
from optkit.io.models import ArchSpec, load
from optkit.passes.prune.passes import StructuredPrune


def _pruned(name, shape=(1, 3, 64, 64)):
    arch = ArchSpec(f"torchvision:{name}", {"num_classes": 10})
    model = arch.build()
    StructuredPrune(ratio=0.3, input_shape=shape)(model)
    return model.eval(), arch


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_b0",
                                  pytest.param("vgg11_bn", marks=pytest.mark.slow)])  # vgg: 14 s of weights
def test_pruned_model_round_trips_with_weights_only(tmp_path, name):
    model, arch = _pruned(name)
    path = tmp_path / "model.pt"
    checkpoint.save(model, path, arch)
    raw = torch.load(path, weights_only=True)
    assert checkpoint.is_slimmed(raw)
    loaded = load(path)
    assert loaded.arch == arch
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(loaded.model.eval()(x), model(x), rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in loaded.model.parameters()) == sum(p.numel() for p in model.parameters())


def test_added_and_replaced_modules_are_rebuilt(tmp_path):
    arch = ArchSpec("torchvision:resnet18", {"num_classes": 4})
    model = arch.build()
    model.conv1 = nn.Sequential(model.conv1, nn.BatchNorm2d(64))
    model.bn1 = nn.Identity()
    model.eval()
    checkpoint.save(model, tmp_path / "m.pt", arch)
    loaded = load(tmp_path / "m.pt").model.eval()
    assert isinstance(loaded.conv1, nn.Sequential) and isinstance(loaded.conv1[1], nn.BatchNorm2d)
    assert isinstance(loaded.bn1, nn.Identity)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model(x))
    assert dict(loaded.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert dict(loaded.named_buffers()).keys() == dict(model.named_buffers()).keys()
    assert all(p.requires_grad for p in loaded.parameters())


def test_class_outside_allowed_packages_is_refused(tmp_path):
    model, arch = _pruned("resnet18")
    path = tmp_path / "m.pt"
    checkpoint.save(model, path, arch)
    raw = torch.load(path, weights_only=True)
    raw["structure"]["fc"] = {"type": "subprocess.Popen", "new": True, "attrs": {}}
    torch.save(raw, path)
    with pytest.raises(ModelLoadError, match="subprocess.Popen.*--trust"):
        load(path)


def test_newer_format_is_refused(tmp_path):
    model, arch = _pruned("resnet18")
    checkpoint.save(model, tmp_path / "m.pt", arch)
    raw = torch.load(tmp_path / "m.pt", weights_only=True)
    raw["version"] = checkpoint.VERSION + 1
    torch.save(raw, tmp_path / "m.pt")
    with pytest.raises(ModelLoadError, match="newer than this optkit"):
        load(tmp_path / "m.pt")


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    model, arch = _pruned("resnet18")
    path = tmp_path / "m.pt"
    checkpoint.save(model, path, arch)
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        checkpoint.save(torchvision.models.resnet18(), path, ArchSpec("torchvision:resnet18"))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_unwrap_sees_through_wrappers():
    inner = nn.Linear(2, 2)

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def optkit_unwrap(self):
            return self.inner

    assert checkpoint.unwrap(Wrapper()) is inner
    assert checkpoint.unwrap(inner) is inner
