"""Which kind a model is, how a kind is named, and the command line on token models: pruned, or one line saying
which --kind / --seq-len to give, never an image-shape error."""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.cli import main
from optkit.core.errors import OptkitError
from optkit.export.onnx import export_onnx
from optkit.io import checkpoint
from optkit.io.architectures import ArchSpec
from optkit.io.models import infer_input_shape, load
from optkit.kinds import ModelInputs, get_kind, kind_of, list_kinds, set_kind
from tests.support.token_models import POSITIONS, LateEmbeddingModel, PlainTokenModel, TinyLlama

ARCH = "tests.support.token_models:{}"


class ImageWithEmbedding(nn.Module):
    """An image model that also owns an embedding table (a class token): still an image model."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.token = nn.Embedding(4, 8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)) + self.token.weight[0])


class PairNet(nn.Module):
    """Two image batches in, one score map out (the plugin kind's model)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 2)

    def forward(self, left, right):
        return self.head((self.features(left) - self.features(right)).mean((2, 3)))


@pytest.mark.parametrize(("build", "expected"), [
    (lambda: load("torchvision:mobilenet_v3_small").model, "image_classifier"),
    (lambda: load("torchvision:fcn_resnet50").model, "segmentation"),
    (lambda: load("torchvision:retinanet_resnet50_fpn").model, "detection"),
    (TinyLlama, "tokens"),
    (PlainTokenModel, "tokens"),
    (LateEmbeddingModel, "tokens"),  # its embedding is registered last: found by the probe forward pass
    (ImageWithEmbedding, "image_classifier"),
], ids=["classifier", "fcn", "retinanet", "hf_llama", "plain_lm", "late_embedding", "image_with_embedding"])
def test_kind_is_inferred_from_structure(build, expected):
    assert kind_of(build()).name == expected


def test_default_shapes_follow_the_kind():
    assert infer_input_shape(load("torchvision:resnet18")) == (1, 3, 224, 224)
    assert infer_input_shape(load("torchvision:inception_v3")) == (1, 3, 299, 299)
    assert infer_input_shape(load("torchvision:ssdlite320_mobilenet_v3_large")) == (1, 3, 320, 320)
    loaded = load("torchvision:resnet18")
    loaded.model = TinyLlama()
    assert infer_input_shape(loaded) == (1, POSITIONS)  # 128 by default, capped at the model's 64 positions


def test_a_hugging_face_image_model_runs_at_its_config_size_and_exports_pixel_values(tmp_path):
    from transformers import ViTMSNConfig, ViTMSNForImageClassification

    config = ViTMSNConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          image_size=64, patch_size=16, num_channels=1, num_labels=3)
    loaded = load("torchvision:resnet18")
    loaded.model = ViTMSNForImageClassification(config).eval()
    assert infer_input_shape(loaded) == (1, 1, 64, 64)  # not 224: a ViT runs at the size its config states
    export_onnx(loaded.model, tmp_path / "vit.onnx", infer_input_shape(loaded))
    session = ort.InferenceSession(str(tmp_path / "vit.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]


def test_only_a_transformers_config_makes_a_hugging_face_model():
    from types import SimpleNamespace

    from optkit.kinds import is_hf_pretrained
    from optkit.passes.prune.hf import describes_transformer

    lookalike = PlainTokenModel()
    lookalike.config = SimpleNamespace(hidden_size=32, num_attention_heads=4, image_size=64)
    lookalike.save_pretrained = lambda folder: None
    lookalike.main_input_name = "input_ids"
    assert not is_hf_pretrained(lookalike) and not describes_transformer(lookalike)
    assert get_kind("image_classifier").default_shape(lookalike) == (1, 3, 224, 224)  # its image_size is not read
    assert is_hf_pretrained(TinyLlama()) and describes_transformer(TinyLlama())


def test_built_in_kinds_register_as_plugins_do_and_the_cli_lists_them():
    from optkit.kinds import builtin_kinds

    assert builtin_kinds() == ["detection", "image_classifier", "segmentation", "tokens"]
    assert set(builtin_kinds()) < set(list_kinds())
    assert all(type(get_kind(name)).__module__.startswith("optkit.kinds.") for name in builtin_kinds())
    help_text = " ".join(CliRunner().invoke(main, ["optimize", "--help"]).output.split())
    assert "detection, image_classifier, segmentation, tokens (or one a plugin registers)" in help_text


def test_a_named_kind_wins_survives_copies_and_model_pt(tmp_path):
    model = set_kind(PlainTokenModel(), "image_classifier")
    assert kind_of(copy.deepcopy(model)).name == "image_classifier"
    checkpoint.save(model, tmp_path / "model.pt", ArchSpec(ARCH.format("PlainTokenModel")))
    assert kind_of(load(tmp_path / "model.pt").model).name == "image_classifier"
    assert kind_of(set_kind(model, None)).name == "tokens"
    with pytest.raises(OptkitError, match="unknown model kind 'nosuch'; choose from detection, segmentation"):
        get_kind("nosuch")


def test_inputs_substitute_their_tensors_in_call_order():
    images = [torch.zeros(3, 4, 4), torch.ones(3, 4, 4)]
    inputs = ModelInputs((images,), {"mask": torch.full((2,), 7.0), "flag": False}, ("a", "b", "m"))
    assert [float(t.mean()) for t in inputs.tensors()] == [0.0, 1.0, 7.0]
    swapped = inputs.with_tensors([torch.full((1,), float(v)) for v in (4, 5, 6)])
    assert [float(t) for t in swapped.args[0]] == [4.0, 5.0] and float(swapped.kwargs["mask"]) == 6.0
    assert swapped.kwargs["flag"] is False and inputs.batch_size == 2


def test_detections_match_as_sets_and_a_missing_one_fails():
    kind = get_kind("detection")
    boxes = np.array([[0, 0, 10, 10], [5, 5, 20, 20], [1, 2, 3, 4]], dtype=np.float32)
    scores, labels = np.array([0.9, 0.8, 0.7], dtype=np.float32), np.array([1, 2, 1])
    order = [2, 0, 1]
    moved = boxes[order] + np.float32(0.25)
    diff, scale = kind.compare([boxes, scores, labels], [moved, scores[order], labels[order]])
    assert diff == pytest.approx(0.25) and scale == 20
    many = np.tile(boxes, (10, 1)) + np.arange(30, dtype=np.float32)[:, None] * 30  # 30 distinct boxes
    many_scores, many_labels = np.linspace(0.9, 0.1, 30, dtype=np.float32), np.ones(30, dtype=np.int64)
    one_flipped = many.copy()
    one_flipped[-1] += 100  # the last one kept differs: allowed (1 of 30)
    assert kind.compare([many, many_scores, many_labels], [one_flipped, many_scores, many_labels])[0] == 0
    two_flipped = one_flipped.copy()
    two_flipped[0] += 100
    with pytest.raises(ValueError, match="2 of 30 detections have no counterpart"):
        kind.compare([many, many_scores, many_labels], [two_flipped, many_scores, many_labels])


def test_near_ties_resolved_the_other_way_are_allowed_but_not_a_score_apart():
    kind = get_kind("detection")
    boxes = np.arange(30, dtype=np.float32)[:, None] * 30 + np.array([0, 0, 20, 20], dtype=np.float32)
    scores, labels = np.linspace(0.9, 0.1, 30, dtype=np.float32), np.ones(30, dtype=np.int64)
    # Suppression kept another box in 6 places: 3 pixels off, overlapping, the score within 5e-4.
    swapped, swapped_scores = boxes.copy(), scores.copy()
    swapped[::5] += np.float32(3.0)
    swapped_scores[::5] += np.float32(5e-4)
    assert kind.compare([boxes, scores, labels], [swapped, swapped_scores, labels])[0] == 0
    apart = scores.copy()
    apart[::5] += np.float32(0.01)
    with pytest.raises(ValueError, match="6 of 30 detections have no counterpart, near-ties apart"):
        kind.compare([boxes, scores, labels], [swapped, apart, labels])


def test_the_plugin_kind_is_one_module_and_exports_both_inputs(tmp_path):
    assert "image_pair" in list_kinds()
    model = set_kind(PairNet().eval(), "image_pair")
    path = tmp_path / "pair.onnx"
    export_onnx(model, path, (1, 3, 16, 16))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["left", "right"]
    left, right = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(left, right).numpy()
    (actual,) = session.run(None, {"left": left.numpy(), "right": right.numpy()})
    np.testing.assert_allclose(actual, expected, atol=1e-5)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lm") / "TinyLlama.pt"
    torch.save(TinyLlama().state_dict(), path)
    return path


def test_optimize_prunes_a_token_model_given_as_state_dict_and_arch(llama_file, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", str(llama_file), "--arch", ARCH.format("TinyLlama"),
                                       "--prune", "0.3", "--seq-len", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    reloaded = load(out).model  # a transformers class: the result is the save_pretrained folder
    widths = {n: tuple(p.shape) for n, p in reloaded.named_parameters()}
    assert widths["model.layers.0.mlp.up_proj.weight"][0] < 160
    assert widths["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads: one of 2 KV groups
    assert reloaded.config.num_attention_heads == 2 and reloaded.config.num_key_value_heads == 1
    assert "input_shape = [1, 32]" in (out / "recipe.toml").read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--seq-len", "65"], "sequence length 65 is beyond the model's 64 positions; set --seq-len 64 or less"),
    (["--input-shape", "1,3,224,224"], "a token model takes inputs of shape N,L"),
    (["--seq-len", "8", "--input-shape", "1,8"], "give --seq-len or --input-shape, not both"),
    (["--kind", "nosuch"], "unknown model kind 'nosuch'"),
    (["--kind", "image_classifier"], "input shape 1,3,224,224 (kind image_classifier: "),
    (["--kind", "image_classifier"], "if it takes token ids, give --kind tokens and --seq-len L"),
])
def test_token_model_mistakes_get_one_line_and_write_nothing(llama_file, tmp_path, flags, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", str(llama_file), "--arch", ARCH.format("TinyLlama"),
                                       "--prune", "0.3", "--out", str(out), *flags])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())
