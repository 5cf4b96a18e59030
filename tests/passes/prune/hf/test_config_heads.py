"""Attention heads of models whose config states a head count per stage (a Swin's ``num_heads`` list): whole heads
go where a stage's new width is a whole number of head widths, heads narrow elsewhere, and the stock class
reloads the result."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from optkit.passes.prune.hf import config_heads  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from tests.support.stock_reload import (  # noqa: E402
    IMAGE, assert_stock_class_reloads, attention_units, pixels, tiny_swin)

HEAD_DIM = 16


def _call_of(model, module):
    """``module``'s first call (args, kwargs) and output in a forward pass of ``model``."""
    seen = []
    hook = module.register_forward_hook(lambda m, a, k, o: seen.append((a, k, o)), with_kwargs=True)
    with torch.no_grad():
        model(pixel_values=pixels())
    hook.remove()
    return seen[0]


def test_cutting_a_unit_to_fewer_heads_drops_the_weakest_and_keeps_the_others_exactly():
    """Head 2 of 4 writes nothing (its output columns are zero) and has the smallest weights: cut to 3 heads,
    the attention's output is unchanged, and heads 0, 1, 3 keep their q/k/v rows, output columns and bias
    table column."""
    model = tiny_swin()
    name = "swin.encoder.layers.1.blocks.0.attention"
    attention, unit = model.get_submodule(name), attention_units(model)[name]
    dead = slice(2 * HEAD_DIM, 3 * HEAD_DIM)
    with torch.no_grad():
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            linear.weight[dead] *= 1e-3
        attention.o_proj.weight[:, dead] = 0.0
    args, kwargs, (expected, _) = _call_of(model, attention)
    original = {n: p.detach().clone() for n, p in attention.named_parameters()}

    config_heads.cut(model, [unit], {name: (3, 3 * HEAD_DIM, 1.0)})

    kept = torch.cat([torch.arange(0, 32), torch.arange(48, 64)])
    for linear in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(getattr(attention, linear).weight, original[f"{linear}.weight"][kept], rtol=0,
                                   atol=0)
    torch.testing.assert_close(attention.o_proj.weight, original["o_proj.weight"][:, kept], rtol=0, atol=0)
    table = "relative_position_bias.relative_position_bias_table"
    torch.testing.assert_close(attention.get_parameter(table), original[table][:, [0, 1, 3]], rtol=0, atol=0)
    with torch.no_grad():
        actual, _ = attention(*args, **kwargs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_narrowing_every_head_keeps_the_strongest_dims_of_each_and_their_scores():
    """Each of the 2 heads has 4 dims (different ones per head) that carry nothing: cut to 2 heads of 12, with
    the query and key rows rescaled for the class's sharper 12 ** -0.5 scaling, the attention's output is
    unchanged."""
    model = tiny_swin()
    name = "swin.encoder.layers.0.blocks.1.attention"
    attention, unit = model.get_submodule(name), attention_units(model)[name]
    empty = torch.tensor([0, 5, 9, 13, HEAD_DIM + 2, HEAD_DIM + 3, HEAD_DIM + 10, HEAD_DIM + 15])
    with torch.no_grad():
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            linear.weight[empty] = 0.0
            linear.bias[empty] = 0.0
        attention.o_proj.weight[:, empty] = 0.0
    args, kwargs, (expected, _) = _call_of(model, attention)

    # The stock class will score 12-wide heads with 12 ** -0.5 instead of 16 ** -0.5.
    config_heads.cut(model, [unit], {name: (2, 24, (16 / 12) ** 0.5)})

    assert attention.q_proj.weight.shape == (24, 32) and attention.o_proj.weight.shape == (32, 24)
    attention.head_dim, attention.scaling = 12, 12 ** -0.5  # what the stock class derives from the edited config
    with torch.no_grad():
        actual, _ = attention(*args, **kwargs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ratio, embed_dim, num_heads", [(0.3, 24, [2, 3]), (0.5, 16, [1, 2])])
def test_a_swin_keeps_whole_heads_where_the_stage_width_allows_and_the_stock_class_reloads_it(
        ratio, embed_dim, num_heads, tmp_path):
    """At 0.3 the stage widths go 32 -> 24 (not a whole number of 16-wide heads: 2 heads of 12) and 64 -> 48
    (3 whole heads of 16); at 0.5, 16 and 32: 1 and 2 whole heads."""
    model = tiny_swin()
    before = sum(p.numel() for p in model.parameters())

    result = StructuredPrune(ratio=ratio, input_shape=(1, 3, IMAGE, IMAGE), round_to=8).apply(model)

    pruned = result.model
    assert (pruned.config.embed_dim, list(pruned.config.num_heads)) == (embed_dim, num_heads)
    for stage, heads in enumerate(num_heads):
        for block in pruned.swin.encoder.layers[stage].blocks:
            width = embed_dim * 2 ** stage
            assert block.attention.q_proj.weight.shape == (width, width)
            assert block.attention.head_dim == width // heads
            assert block.attention.relative_position_bias.relative_position_bias_table.shape[1] == heads
    assert sum(p.numel() for p in pruned.parameters()) < 0.8 * before

    assert_stock_class_reloads(pruned, transformers.SwinForImageClassification, tmp_path)


def test_a_swin_v2_with_its_attention_output_beside_the_heads_reloads_too(tmp_path):
    model = tiny_swin(transformers.Swinv2Config, transformers.Swinv2ForImageClassification)

    result = StructuredPrune(ratio=0.3, input_shape=(1, 3, IMAGE, IMAGE), round_to=8).apply(model)

    pruned = result.model
    assert (pruned.config.embed_dim, list(pruned.config.num_heads)) == (24, [2, 3])
    block = pruned.swinv2.encoder.layers[1].blocks[0].attention.self
    assert block.logit_scale.shape == (3, 1, 1) and block.continuous_position_bias_mlp[2].weight.shape == (3, 512)
    assert_stock_class_reloads(pruned, transformers.Swinv2ForImageClassification, tmp_path)
