"""Channel pruning of ``transformers`` models whose widths vary by stage keeps widths their config can state
(Swin's heads: ``test_config_heads.py``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from tests.support.stock_reload import IMAGE, assert_stock_class_reloads, pixels  # noqa: E402



def _swin():
    torch.manual_seed(0)
    config = transformers.SwinConfig(embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, image_size=IMAGE,
                                     patch_size=2, num_labels=10)
    return transformers.SwinForImageClassification(config).eval()




def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _convnext():
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 2, 1, 1], num_labels=10,
                                         image_size=IMAGE)
    return transformers.ConvNextForImageClassification(config).eval()


def test_a_convnext_is_pruned_to_the_stage_widths_its_config_states_and_the_stock_class_reloads_it(tmp_path):
    model = _convnext()
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE), round_to=8).apply(model)

    pruned = result.model
    # 0.7 of each stage width, rounded to a multiple of 8: 22.4 -> 24, 44.8 -> 48, 89.6 -> 88, 179.2 -> 176.
    assert list(pruned.config.hidden_sizes) == [24, 48, 88, 176]
    assert result.details["config_widths"] == {"hidden_sizes": [24, 48, 88, 176]}
    for stage, width in enumerate([24, 48, 88, 176]):
        for layer in pruned.convnext.encoder.stages[stage].layers:
            assert layer.dwconv.weight.shape == (width, 1, 7, 7)
            assert layer.pwconv1.weight.shape == (4 * width, width)
    assert pruned.classifier.weight.shape == (10, 176)
    assert 0.45 * before < _params(pruned) < 0.55 * before

    assert_stock_class_reloads(pruned, transformers.ConvNextForImageClassification, tmp_path)


def test_a_convnext_v2_whose_response_norm_is_four_dimensional_reloads_too(tmp_path):
    """ConvNeXt-V2's global response norm holds 1x1x1xC parameters: they narrow with the stage widths."""
    torch.manual_seed(0)
    config = transformers.ConvNextV2Config(hidden_sizes=[32, 64, 128, 256], depths=[1, 2, 1, 1], num_labels=10,
                                           image_size=IMAGE)
    model = transformers.ConvNextV2ForImageClassification(config).eval()
    with torch.no_grad():  # zero at init; values make a wrongly kept channel visible in the logits
        for name, param in model.named_parameters():
            if ".grn." in name:
                param.normal_(0.0, 0.5)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE), round_to=8).apply(model)

    pruned = result.model
    assert list(pruned.config.hidden_sizes) == [24, 48, 88, 176]
    assert pruned.convnextv2.encoder.stages[1].layers[0].grn.weight.shape == (1, 1, 1, 4 * 48)
    assert_stock_class_reloads(pruned, transformers.ConvNextV2ForImageClassification, tmp_path)


def test_widths_that_must_move_together_are_edited_together_and_a_resnet_reloads(tmp_path):
    """A ResNet's stem (embedding_size) equals its first stage's width, so either edited alone adds a shortcut
    projection: the two are scaled together."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                                       num_labels=10)
    model = transformers.ResNetForImageClassification(config).eval()
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE), round_to=8).apply(model)

    pruned = result.model
    assert result.details["config_widths"] == {"embedding_size": 24, "hidden_sizes": [24, 48, 88, 176]}
    assert _params(pruned) < 0.6 * before
    assert_stock_class_reloads(pruned, transformers.ResNetForImageClassification, tmp_path)


def test_fields_that_are_not_channel_widths_are_left_alone():
    """Patch size changes a kernel, window size a position table, num_channels the input and num_labels the
    output: none is a width a channel prune may change. The head counts follow the widths (whole 16-wide heads
    of the halved stages, :mod:`optkit.passes.prune.hf.config_heads`)."""
    from optkit.passes.prune.hf.config_widths import describe

    model = _swin()
    settings = StructuredPrune(ratio=0.5, input_shape=(1, 3, IMAGE, IMAGE))
    spec = settings.spec()

    described = describe(model, spec, spec.uniform(0.5, 8))

    assert described is not None and described.edits == {"embed_dim": 16, "mlp_ratio": 2.0, "num_heads": [1, 2]}


def test_a_model_its_config_no_longer_describes_is_pruned_freely():
    """Weights already narrowed by hand: the config cannot rebuild the model, so no config edit is tried and
    channel pruning runs as for any model."""
    from optkit.passes.prune.hf.config_widths import describe

    model = _convnext()
    layer = model.convnext.encoder.stages[0].layers[0]
    layer.pwconv1 = torch.nn.Linear(layer.pwconv1.in_features, 100)
    layer.pwconv2 = torch.nn.Linear(100, layer.pwconv2.out_features)
    narrowed = _params(model)
    settings = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE), round_to=8)
    spec = settings.spec()

    assert describe(model, spec, spec.uniform(0.3, 8)) is None
    result = settings.apply(model)
    assert "config_widths" not in result.details and list(result.model.config.hidden_sizes) == [32, 64, 128, 256]
    assert _params(result.model) < 0.7 * narrowed
