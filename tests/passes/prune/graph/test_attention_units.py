"""Attention and patch merging that torch-pruning breaks on, found by structure and pruned as units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optkit.passes.prune.graph import arch as _arch
from optkit.passes.prune.graph import attention as _attention
from optkit.passes.prune.graph import merging as _merging
from optkit.passes.prune.passes import StructuredPrune

TOKENS, WIDTH, HEADS = 16, 64, 4


class WidthHeadsAttention(nn.Module):
    """Head width computed from the input width (``C // num_heads``), optionally a reduced key/value path."""

    def __init__(self, dim: int, num_heads: int, reduce: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.sr = nn.Conv1d(dim, dim, 2, stride=2) if reduce else None
        self.norm = nn.LayerNorm(dim) if reduce else None

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
        if self.sr is not None:
            x = self.norm(self.sr(x.transpose(1, 2)).transpose(1, 2))
        k, v = self.kv(x).reshape(B, -1, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class StoredHeadDimAttention(nn.Module):
    """Head width stored (``head_dim``), output reshaped with -1: its heads can be pruned on their own."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), attn
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, make_attention) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(*(Block(make_attention()) for _ in range(2)))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


SHAPE = (1, TOKENS, 8)


@pytest.mark.parametrize("reduce", [False, True], ids=["plain", "reduced-kv"])
def test_attention_with_width_derived_heads_is_pruned_as_a_unit(reduce):
    torch.manual_seed(0)
    model = Transformer(lambda: WidthHeadsAttention(WIDTH, HEADS, reduce))
    x = torch.randn(*SHAPE)
    units = _attention.find_tied_attention(model, x, set(), set())
    assert [u.module for u in units] == [b.attn for b in model.blocks]
    details = StructuredPrune(ratio=0.3, input_shape=SHAPE).apply(model).details
    assert "held_layers" not in details
    attn = model.blocks[0].attn
    width = model.embed.out_features
    # Residual channels go in 4 equal chunks (one per head): 16 * 0.7 = 11 per chunk, rounded down to a
    # multiple of 4 so the width stays a multiple of round_to=16.
    assert width == 32 and attn.num_heads == HEADS
    assert (attn.q.out_features, attn.kv.out_features, attn.proj.in_features) == (width, 2 * width, width)
    if reduce:
        assert attn.sr.in_channels == attn.sr.out_channels == width and attn.norm.normalized_shape == (width,)
    out = model.train()(torch.randn(2, *SHAPE[1:]))
    assert out.shape == (2, 10)
    out.sum().backward()


def test_attention_whose_heads_prune_alone_is_left_to_torch_pruning():
    torch.manual_seed(0)
    model = Transformer(lambda: StoredHeadDimAttention(WIDTH, HEADS))
    x = torch.randn(*SHAPE)
    assert _attention.find_tied_attention(model, x, set(), {b.attn for b in model.blocks}) == []
    # Without the head count known to torch-pruning, it is pruned as a unit instead.
    assert len(_attention.find_tied_attention(model, x, set(), set())) == 2
    support = _arch.arch_support(model, x)
    assert support.opaque == [] and {a.module for a in support.attention} == {b.attn for b in model.blocks}


def test_tied_prune_drops_one_dim_per_head_for_every_head_count_of_channels():
    torch.manual_seed(0)
    attn = WidthHeadsAttention(WIDTH, HEADS)
    unit = _attention.TiedAttention(attn, [(attn.q, 1), (attn.kv, 2)], [], attn.proj, HEADS)
    with pytest.raises(ValueError, match="cannot keep 63 of 64"):
        unit.prune([5])
    kept = [i for i in range(WIDTH) if i % 16]
    unit.prune(list(range(0, WIDTH, 16)))  # 4 residual channels go, so 1 dim of each of the 4 heads
    assert attn.q.weight.shape == (60, 60) and attn.kv.weight.shape == (120, 60) and attn.proj.weight.shape == (60, 60)
    assert attn(torch.randn(2, TOKENS, WIDTH)[..., kept]).shape == (2, TOKENS, 60)


class ChannelsLastMerging(nn.Module):
    """2x2 neighbours folded into channels (``4C``, neighbour-major), normed, projected to ``2C``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        B, H, W, C = x.shape
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class MergingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.merge = ChannelsLastMerging(32)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.merge(self.stem(x).permute(0, 2, 3, 1))
        x = x + self.mlp(x)
        return self.head(x.mean((1, 2)))


def test_channels_last_patch_merging_is_found_and_pruned():
    torch.manual_seed(0)
    model = MergingNet()
    shape = (1, 3, 8, 8)
    units = _merging.find_merging(model, torch.randn(*shape), set())
    assert [(u.module, u.repeats, u.width) for u in units] == [(model.merge, 4, 32)]
    details = StructuredPrune(ratio=0.3, input_shape=shape).apply(model).details
    assert "held_layers" not in details
    merge = model.merge
    assert model.stem.out_channels == merge.dim == 16  # 32 * 0.7 rounded down to 16
    assert merge.reduction.in_features == 4 * 16 and merge.norm.normalized_shape == (64,)
    assert merge.reduction.out_features == 32 and model.mlp[0].in_features == 32  # 64 * 0.7 rounded down to 32
    out = model.train()(torch.randn(2, *shape[1:]))
    assert out.shape == (2, 10)
    out.sum().backward()
