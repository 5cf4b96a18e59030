"""One pipeline for every built-in kind: structured prune -> ONNX export -> ONNX Runtime parity, checked here apart
from optkit's own verification, on real architectures built by name or from transformers configs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from optkit.core.pipeline import Pipeline
from optkit.export.onnx import export_onnx
from optkit.io.models import load
from optkit.kinds import kind_of
from optkit.passes.prune import StructuredPrune
from tests.support.token_models import VOCAB, PlainTokenModel, TinyBertClassifier, TinyLlama


def _params(model: torch.nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters() if name.startswith(prefix)}


def _pruned_and_exported(model, shape, tmp_path):
    run = Pipeline([StructuredPrune(ratio=0.3)], input_shape=shape).run(model)
    path = tmp_path / "model.onnx"
    export_onnx(run.model, path, shape)
    return run, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_image_classifier(tmp_path):
    model = load("torchvision:resnet18", num_classes=7).model.eval()
    assert kind_of(model).name == "image_classifier"
    run, session = _pruned_and_exported(model, (1, 3, 64, 64), tmp_path)
    assert run.after.macs < 0.8 * run.before.macs
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = run.model(x).numpy()
    (actual,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert actual.shape == (2, 7)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_segmentation_by_name_keeps_its_heads(tmp_path):
    model = load("torchvision:lraspp_mobilenet_v3_large", num_classes=4).model.eval()
    assert kind_of(model).name == "segmentation"
    heads_before = _params(model, "classifier")
    run, session = _pruned_and_exported(model, (1, 3, 96, 96), tmp_path)
    assert _params(run.model, "classifier") == heads_before
    assert sum(np.prod(s) for s in _params(run.model, "backbone").values()) < 0.8 * sum(
        np.prod(s) for s in _params(load("torchvision:lraspp_mobilenet_v3_large", num_classes=4).model, "backbone").values())
    x = torch.rand(1, 3, 96, 96, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = run.model(x)["out"].numpy()
    actual = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert actual.shape == (1, 4, 96, 96)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_detection_by_name_detects_the_same_boxes_after_export(tmp_path):
    # Untrained weights score every box alike (100 detections within 0.01), so which ones make the cut moves with
    # the last digits: a fixed seed keeps the check about the export, not about one draw of near-ties.
    torch.manual_seed(0)
    model = load("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", num_classes=5).model.eval()
    assert kind_of(model).name == "detection"
    heads_before = {**_params(model, "rpn"), **_params(model, "roi_heads")}
    fpn_before = _params(model, "backbone.fpn.layer_blocks")
    run, session = _pruned_and_exported(model, (1, 3, 160, 160), tmp_path)
    assert {**_params(run.model, "rpn"), **_params(run.model, "roi_heads")} == heads_before
    # The feature maps the heads read keep their 256 channels.
    assert {n: s[0] for n, s in _params(run.model, "backbone.fpn.layer_blocks").items()} == {
        n: s[0] for n, s in fpn_before.items()}
    assert run.after.params < 0.95 * run.before.params
    image = torch.rand(3, 160, 160, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        (expected,) = run.model([image])
    boxes, scores, labels = session.run(None, {session.get_inputs()[0].name: image.numpy()})
    assert len(expected["boxes"]) > 0, "the check needs an input on which the model detects something"
    assert len(boxes) == len(expected["boxes"])
    # Untrained detectors score many boxes alike, so suppression may keep a different one of two near-equal
    # boxes: nearly every PyTorch detection must have an ONNX Runtime detection of its label, box and score.
    found = [bool(np.any((labels == label) & (np.abs(boxes - box).max(axis=1) < 1e-2) & (np.abs(scores - score) < 1e-4)))
             for box, score, label in zip(expected["boxes"].numpy(), expected["scores"].numpy(), expected["labels"].numpy())]
    assert np.mean(found) >= 0.95


@pytest.mark.parametrize("model_class", [TinyBertClassifier, TinyLlama], ids=["encoder", "causal_lm"])
def test_token_models_from_transformers_configs(model_class, tmp_path):
    torch.manual_seed(0)
    model = model_class().eval()
    assert kind_of(model).name == "tokens"
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = config.hidden_size // heads
    embeddings_before = {n: s for n, s in _params(model, "").items() if "embed" in n}
    run, session = _pruned_and_exported(model, (1, 16), tmp_path)
    after = _params(run.model, "")
    # The hidden size is kept, or (in a class whose head width is hidden / heads, as BERT's) shrinks with
    # the heads so that the head width stays; the embeddings follow it and nothing else of theirs changes.
    new_hidden = run.model.config.hidden_size
    assert new_hidden in (config.hidden_size, run.model.config.num_attention_heads * head_dim)
    assert {n: after[n] for n in embeddings_before} == {n: (*s[:-1], new_hidden) for n, s in embeddings_before.items()}
    mlp_widths = [s[0] for n, s in after.items() if n.endswith(("intermediate.dense.weight", "up_proj.weight"))]
    assert mlp_widths and all(width < 160 for width in mlp_widths)
    # Heads go whole: every query/key projection is a multiple of the unchanged head size, consistent with the
    # config, and grouped-query attention keeps its query-to-KV ratio.
    new_heads = run.model.config.num_attention_heads
    new_kv = getattr(run.model.config, "num_key_value_heads", new_heads)
    assert new_heads * kv_heads == new_kv * heads
    for name, shape in after.items():
        if name.endswith(("q_proj.weight", "self.query.weight")):
            assert shape[0] == new_heads * head_dim, name
        if name.endswith(("k_proj.weight", "self.key.weight")):
            assert shape[0] == new_kv * head_dim, name
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = run.model(input_ids=ids, attention_mask=mask).logits.numpy()
    names = [i.name for i in session.get_inputs()]
    assert names == ["input_ids", "attention_mask"]
    (actual,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    assert actual.shape == expected.shape  # batch and sequence length both dynamic
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_a_token_model_written_with_torch_nn_alone_is_pruned_in_its_mlp(tmp_path):
    torch.manual_seed(0)
    model = PlainTokenModel().eval()
    run, session = _pruned_and_exported(model, (1, 12), tmp_path)
    assert run.model.block.linear1.out_features < 96  # the feed-forward width
    assert run.model.embed.embedding_dim == 32 and run.model.block.self_attn.embed_dim == 32
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = run.model(ids).numpy()
    (actual,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
