import pickle

import pytest
import torch
import torchvision

from optkit.core.errors import ModelLoadError
from optkit.io.models import load, load_model, read_checkpoint


class Detonator:
    """Unpickling this runs code: it creates the file named in ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_torchvision_spec_builds_with_num_classes():
    loaded = load("torchvision:mobilenet_v2", num_classes=7)
    assert loaded.model(torch.randn(1, 3, 64, 64)).shape == (1, 7)
    assert loaded.arch.spec == "torchvision:mobilenet_v2" and loaded.arch.kwargs == {"num_classes": 7}


def test_unknown_torchvision_name_suggests_close_ones():
    with pytest.raises(ModelLoadError, match="unknown torchvision model 'resnet19'.*resnet18"):
        load("torchvision:resnet19")


def test_state_dict_with_torchvision_arch(tmp_path):
    source = torchvision.models.resnet18(num_classes=5)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    model = load_model(tmp_path / "w.pt", arch="torchvision:resnet18", num_classes=5).eval()
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(model(x), source.eval()(x))


def test_state_dict_nested_under_a_key(tmp_path):
    torch.save({"epoch": 3, "state_dict": torchvision.models.resnet18(num_classes=3).state_dict()}, tmp_path / "c.pt")
    assert load_model(tmp_path / "c.pt", arch="torchvision:resnet18", num_classes=3).fc.out_features == 3


def test_state_dict_with_user_class(tmp_path):
    from usernets import BranchyNet

    torch.save(BranchyNet(num_classes=4).state_dict(), tmp_path / "w.pt")
    loaded = load(tmp_path / "w.pt", arch="usernets:BranchyNet", num_classes=4)
    assert loaded.model.head.out_features == 4
    assert loaded.arch.spec == "usernets:BranchyNet"


def test_state_dict_without_arch_says_which_flag(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelLoadError, match="--arch torchvision:NAME"):
        load(tmp_path / "w.pt")


def test_state_dict_that_does_not_match_the_arch(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelLoadError, match="does not match --arch torchvision:resnet34"):
        load(tmp_path / "w.pt", arch="torchvision:resnet34")


@pytest.mark.parametrize("wrap", [lambda d: d, lambda d: {"nested": [d]}], ids=["plain", "nested"])
def test_code_in_a_pickle_never_runs_without_trust(tmp_path, wrap):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save(wrap(Detonator(marker)), path)
    with pytest.raises(ModelLoadError, match="--trust"):
        load(path)
    assert not marker.exists()


def test_raw_pickle_is_refused_without_trust(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(Detonator(marker)))
    with pytest.raises(ModelLoadError, match="--trust"):
        read_checkpoint(path)
    assert not marker.exists()


def test_whole_module_loads_only_with_trust(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(torchvision.models.resnet18(num_classes=3), path)
    with pytest.raises(ModelLoadError, match="--trust"):
        load(path)
    loaded = load(path, trust=True)
    assert loaded.arch is None and loaded.model.fc.out_features == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.write_text("hello, I am text\n"), "not a PyTorch checkpoint"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: torch.save([1, 2, 3], p), "not a model checkpoint"),
    ],
    ids=["missing", "empty", "text", "directory", "list"],
)
def test_unusable_files_give_clear_errors(tmp_path, make, message):
    path = tmp_path / "model.pt"
    make(path)
    with pytest.raises(ModelLoadError, match=message):
        load(path)


def test_unimportable_user_class(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelLoadError, match="cannot import no_such_pkg.mod:Net"):
        load(tmp_path / "w.pt", arch="no_such_pkg.mod:Net")


DOWNLOADING_BUILDERS = ["ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn",
                        "lraspp_mobilenet_v3_large"]


def test_the_network_guard_catches_a_default_backbone_download():
    # torchvision's own default (weights_backbone=ImageNet) must trip conftest's guard,
    # or the test below could not fail.
    with pytest.raises(AssertionError, match="network access attempted"):
        torchvision.models.get_model("lraspp_mobilenet_v3_large", weights=None)


@pytest.mark.parametrize("name", DOWNLOADING_BUILDERS)
def test_detection_and_segmentation_models_build_without_downloading(name):
    loaded = load(f"torchvision:{name}", num_classes=3)
    model = loaded.model.eval()
    with torch.no_grad():
        output = model([torch.rand(3, 96, 96)]) if "rcnn" in name or "ssd" in name else model(torch.rand(1, 3, 64, 64))
    if isinstance(output, list):
        assert set(output[0]) == {"boxes", "scores", "labels"}
    else:
        assert output["out"].shape == (1, 3, 64, 64)


def _mismatch_error(tmp_path, arch, **kwargs) -> str:
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelLoadError) as caught:
        load(tmp_path / "w.pt", arch=arch, **kwargs)
    return str(caught.value)


def test_wrong_arch_is_one_short_line_with_counts(tmp_path):
    message = _mismatch_error(tmp_path, "torchvision:resnet50")
    model_keys = torchvision.models.resnet50().state_dict()
    file_keys = torchvision.models.resnet18(num_classes=10).state_dict()
    expected, found = set(model_keys), set(file_keys)
    shared_misshaped = sum(model_keys[k].shape != file_keys[k].shape for k in expected & found)
    assert "\n" not in message and len(message) < 400, message
    assert (f"{len(expected - found)} missing, {len(found - expected)} unexpected and "
            f"{shared_misshaped} mis-shaped keys") in message
    assert "--arch" in message and "--num-classes" in message


def test_wrong_num_classes_names_the_mis_shaped_classifier(tmp_path):
    message = _mismatch_error(tmp_path, "torchvision:resnet18", num_classes=7)
    assert "\n" not in message and len(message) < 400, message
    assert "0 missing, 0 unexpected and 2 mis-shaped keys" in message
    assert "fc.weight: file 10x512, model 7x512" in message
