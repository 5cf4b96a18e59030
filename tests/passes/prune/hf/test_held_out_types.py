"""Hugging Face types held out from the development sets (issue #41): what the stock class fixes (ALiBi heads, a
4x MLP) is reached through the residual stream; heads indexed beside their projections (a bias shared by every
block, a per-head conv, a head reading every block's maps) go with those tensors; config fields that only build a
running model together are edited together; one head count for stages of different widths; and the width search
shows progress and stops at its budget."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from optkit.core import progress as progress_module  # noqa: E402
from optkit.core.progress import show_progress  # noqa: E402
from optkit.passes.prune.hf import config_widths  # noqa: E402
from optkit.passes.prune.hf.config_heads import HeadFields  # noqa: E402
from optkit.passes.prune.hf.head_units import Interior  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from tests.support.stock_reload import IMAGE, assert_stock_class_reloads  # noqa: E402

TOKENS = dict(vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCODER = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=40, num_labels=3)
SEQ = 16


def _tiny(model_type: str, model_class, tokens: bool = True, **sizes):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **(TOKENS if tokens else {}), **sizes)
    return model_class.from_config(config).eval()


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _reloads(model, model_class, folder) -> None:
    """The stock class loads ``model``'s folder with every key in place and the same logits (1e-4)."""
    assert_stock_class_reloads(model, model_class, folder, inputs={"input_ids": _ids()}, atol=1e-4)


def _columns_from(new: torch.Tensor, old: torch.Tensor) -> list[int]:
    """For each column of ``new``, the index of the equal column of ``old``."""
    return [next(j for j in range(old.shape[1]) if torch.equal(new[:, i], old[:, j])) for i in range(new.shape[1])]


def test_an_alibi_decoder_whose_class_fixes_heads_and_mlp_narrows_its_stream_and_reloads(tmp_path):
    """Bloom: ALiBi slopes follow each head's position and count (no head can go), the MLP is 4x the hidden size
    (no channel can go alone). The stream narrows instead, 64 -> 48, every head to 12 of its 16 dims (the four
    that carry nothing go) and the MLP to 4 x 48, within 0.8x the parameters; the stock class reloads it."""
    model = _tiny("bloom", transformers.AutoModelForCausalLM, hidden_size=64, n_layer=2, n_head=4)
    with torch.no_grad():
        for block in model.transformer.h:  # dims 12..15 of every head carry nothing (fused rows: head, q/k/v, dim)
            qkv = block.self_attention.query_key_value
            qkv.weight.view(4, 3, 16, 64)[:, :, 12:] = 0
            qkv.bias.view(4, 3, 16)[:, :, 12:] = 0
            block.self_attention.dense.weight.view(64, 4, 16)[:, :, 12:] = 0
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, SEQ)).apply(model)

    assert (model.config.n_head, model.config.hidden_size) == (4, 48)
    assert _params(model) <= 0.8 * before
    for block in model.transformer.h:
        assert block.self_attention.query_key_value.weight.shape == (3 * 48, 48)
        assert block.self_attention.query_key_value.weight.abs().sum(1).min() > 0  # the empty dims went
        assert block.mlp.dense_h_to_4h.weight.shape == (192, 48)
    assert any("hidden size 64->48 instead" in note for note in result.details["notes"])
    _reloads(model, transformers.AutoModelForCausalLM, tmp_path)


def test_heads_indexed_by_a_bias_every_block_shares_go_from_every_block_and_from_the_bias(tmp_path):
    """MPNet computes one relative-position bias (buckets x heads) for all blocks: the same heads go from every
    block, chosen by their scores summed over the blocks, and the bias table loses exactly those columns."""
    model = _tiny("mpnet", transformers.AutoModelForSequenceClassification, **ENCODER)
    table = model.mpnet.encoder.relative_attention_bias.weight.detach().clone()
    before = _params(model)

    StructuredPrune(ratio=0.3, input_shape=(1, SEQ)).apply(model)

    assert (model.config.num_attention_heads, model.config.hidden_size) == (3, 48)
    kept = _columns_from(model.mpnet.encoder.relative_attention_bias.weight.detach(), table)
    assert len(kept) == 3 and kept == sorted(kept)
    assert _params(model) <= 0.8 * before
    _reloads(model, transformers.AutoModelForSequenceClassification, tmp_path)


def test_a_head_reading_every_blocks_attention_maps_keeps_the_kept_heads_columns(tmp_path):
    """ESM: 8 heads of 16 over a 128-wide stream; 6 heads need a 96-wide stream (the class validates hidden % heads),
    and its contact head reads layers x heads attention maps, which keeps each block's kept heads, block by
    block."""
    model = _tiny("esm", transformers.AutoModelForSequenceClassification, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=40, num_labels=3)
    contact = model.esm.contact_head.regression.weight.detach().clone()
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, SEQ)).apply(model)

    assert (model.config.num_attention_heads, model.config.hidden_size) == (6, 96)
    kept = _columns_from(model.esm.contact_head.regression.weight.detach(), contact)
    assert all(0 <= k < 8 for k in kept[:6]) and all(8 <= k < 16 for k in kept[6:]) and kept == sorted(kept)
    assert _params(model) <= 0.8 * before
    assert not any("every head kept" in note for note in result.details["notes"])
    _reloads(model, transformers.AutoModelForSequenceClassification, tmp_path)


def test_a_per_head_parameter_beside_the_projections_goes_with_its_heads(tmp_path):
    """Nystromformer convolves each head's values with a kernel of its own (a conv of heads x 1 x k x 1): its
    attention is found once that conv is permuted with the heads, and it keeps the kept heads' kernels."""
    model = _tiny("nystromformer", transformers.AutoModelForSequenceClassification, **ENCODER,
                  segment_means_seq_len=SEQ, num_landmarks=4, conv_kernel_size=5)
    kernels = [layer.attention.self.conv.weight.detach().clone() for layer in model.nystromformer.encoder.layer]
    before = _params(model)

    StructuredPrune(ratio=0.3, input_shape=(1, SEQ)).apply(model)

    assert model.config.num_attention_heads == 3
    for layer, old in zip(model.nystromformer.encoder.layer, kernels, strict=True):
        new = layer.attention.self.conv.weight.detach()
        assert new.shape == (3, 1, 5, 1)
        assert all(any(torch.equal(kernel, o) for o in old) for kernel in new)
    assert _params(model) <= 0.8 * before
    _reloads(model, transformers.AutoModelForSequenceClassification, tmp_path)


def test_one_head_count_for_stages_of_different_widths_suits_every_stage():
    """MobileViT states one num_attention_heads (4) for stages 32, 48 and 64 wide: narrowed to 16, 32 and 48, only
    4 heads split all three (2 would not split 32 into heads of 12), so the count stays and every head narrows;
    where every stage allows the same number of whole heads, that number is taken."""
    units = [Interior(f"unit{i}", (), f"out{i}", 4, width) for i, width in enumerate((32, 48, 64))]
    fields = HeadFields({("num_attention_heads", None): tuple(u.name for u in units)})

    def built(widths):
        return {f"out{i}.weight": (8, w) for i, w in enumerate(widths)}, None, None

    assert fields.split({"num_attention_heads": 1}, units, built((16, 32, 48))) == {"num_attention_heads": 4}
    assert fields.split({"num_attention_heads": 1}, units, built((16, 24, 32))) == {"num_attention_heads": 2}
    assert fields.split({"num_attention_heads": 1}, units, built((16, 30, 48))) is None


def test_fields_that_build_a_running_model_only_together_are_edited_together(tmp_path):
    """EfficientNet's layer widths follow width_coefficient, its top width is hidden_dim (and must equal the top
    conv's round_filters(1280)): alone, either edit builds a model that does not run; together they are widths."""
    torch.manual_seed(0)
    config = transformers.EfficientNetConfig(image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.3,
                                             hidden_dim=320, pooling_type="max", initializer_range=0.5, num_labels=10)
    model = transformers.EfficientNetForImageClassification(config).eval()
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE)).apply(model)

    assert {"width_coefficient", "hidden_dim"} <= set(result.details["config_widths"])
    assert model.config.hidden_dim == 224 and model.classifier.weight.shape == (10, 224)
    assert _params(model) <= 0.8 * before
    assert_stock_class_reloads(model, transformers.EfficientNetForImageClassification, tmp_path)


def test_the_width_search_shows_progress_and_stops_at_its_budget(monkeypatch):
    """With no time left, the search for width fields stops at once, says so in a note, and the prune goes on
    without it; each field tried is a progress line."""
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=10,
                                         image_size=IMAGE)
    model = transformers.ConvNextForImageClassification(config).eval()
    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.0)
    lines: list[str] = []
    with show_progress(lines.append):
        StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE)).apply(_copy(model))
    assert any("config fields tried as widths" in line for line in lines)

    monkeypatch.setattr(config_widths, "SEARCH_BUDGET_S", 0.0)
    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE)).apply(model)

    assert "config_widths" not in result.details
    assert any("stopped the search for width fields" in note and "budget" in note
               for note in result.details["notes"])


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.slow
def test_a_mobilevit_comes_back_as_a_folder_its_stock_class_reloads(tmp_path):
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(image_size=IMAGE, hidden_sizes=[32, 48, 64],
                                          neck_hidden_sizes=[16, 16, 24, 32, 48, 64, 128], num_attention_heads=4,
                                          num_labels=10)
    model = transformers.MobileViTForImageClassification(config).eval()
    before = _params(model)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE)).apply(model)

    assert "hidden_sizes" in result.details["config_widths"] and model.config.num_attention_heads == 4
    assert _params(model) <= 0.8 * before
    assert_stock_class_reloads(model, transformers.MobileViTForImageClassification, tmp_path)
