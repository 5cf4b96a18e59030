"""Attention units found by structure (:mod:`optkit.passes.prune.hf.head_units`): both places an output projection
can be, the query/key parts, and a layout check that tells heads in blocks from heads interleaved."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

transformers = pytest.importorskip("transformers")

from optkit.passes.prune.hf.head_units import find_interiors  # noqa: E402
from tests.support.stock_reload import attention_units, tiny_swin  # noqa: E402


def test_units_are_found_with_their_projections_in_both_attention_layouts():
    """HF Swin keeps its output projection inside the attention; SwinV2 beside it (``attention.output.dense``)."""
    units = attention_units(tiny_swin())
    assert len(units) == 4 and {u.heads for u in units.values()} == {2, 4}
    unit = units["swin.encoder.layers.1.blocks.0.attention"]
    assert [name.rsplit(".", 1)[1] for name, _ in unit.projections] == ["q_proj", "k_proj", "v_proj"]
    assert unit.output.endswith("attention.o_proj") and (unit.heads, unit.width, unit.head_dim) == (4, 64, 16)
    assert [name.rsplit(".", 1)[1] for name, _ in unit.scores] == ["q_proj", "k_proj"]

    v2 = attention_units(tiny_swin(transformers.Swinv2Config, transformers.Swinv2ForImageClassification))
    unit = v2["swinv2.encoder.layers.0.blocks.1.attention.self"]
    assert unit.output == "swinv2.encoder.layers.0.blocks.1.attention.output.dense"
    assert (unit.heads, unit.width) == (2, 32) and len(v2) == 4


class _Interleaved(nn.Module):
    """Attention whose channels run dim-major (channel = dim * heads + head): not ``heads`` blocks."""

    def __init__(self, width: int = 32, num_heads: int = 4):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, n, c = x.shape

        def split(t):
            return t.view(b, n, c // self.num_heads, self.num_heads).permute(0, 3, 1, 2)
        attention = (split(self.q(x)) @ split(self.k(x)).transpose(-1, -2)).softmax(-1)
        return self.o((attention @ split(self.v(x))).permute(0, 2, 3, 1).reshape(b, n, c))


class _Blocked(_Interleaved):
    def forward(self, x):
        b, n, c = x.shape

        def split(t):
            return t.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)
        attention = (split(self.q(x)) @ split(self.k(x)).transpose(-1, -2)).softmax(-1)
        return self.o((attention @ split(self.v(x))).transpose(1, 2).reshape(b, n, c))


def test_a_unit_is_one_only_when_its_heads_lie_in_blocks():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    assert [u.name for u in find_interiors(nn.Sequential(_Blocked()), [x])] == ["0"]
    assert find_interiors(nn.Sequential(_Interleaved()), [x]) == []


@pytest.mark.parametrize("width, num_heads", [(32, 4), (64, 8), (36, 6)], ids=["4x8", "8x8", "6x6"])
def test_heads_interleaved_dim_major_are_told_from_blocks_even_when_the_head_count_equals_the_head_width(width,
                                                                                                         num_heads):
    """With as many heads as dims per head, a dim-major layout maps onto blocks by swapping heads and dims: only
    a different order of dims in each head (not one shared order) tells the two apart."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, width)
    assert [u.name for u in find_interiors(nn.Sequential(_Blocked(width, num_heads)), [x])] == ["0"]
    assert find_interiors(nn.Sequential(_Interleaved(width, num_heads)), [x]) == []
