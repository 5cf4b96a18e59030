"""Blocks that structured pruning handles as units (Swin v1/v2, MaxViT).

torch-pruning traces channels through reshapes assuming channels are dim 1.
Swin and MaxViT work channels-last and partition windows with reshapes, which
makes its index mapping grow without end (window attention) or map spatial
slices as channel slices (Swin's patch merging). So while the dependency
graph is built, these blocks are shown as one opaque node each, and the
pruning functions here prune them as units:

* window attention ties its inner width to the residual width (``qkv`` maps
  C to 3C, heads are ``C // num_heads`` wide), so residual channels and each
  head's dims shrink together;
* patch merging concatenates four spatial neighbours (4C) and projects to 2C.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class _Layout:
    qkv: str
    proj: str
    heads: str
    head_dim: str | None  # attribute holding the per-head width, if the class stores one


def _layouts() -> dict[type, _Layout]:
    from torchvision.models.maxvit import RelativePositionalMultiHeadAttention
    from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

    swin = _Layout(qkv="qkv", proj="proj", heads="num_heads", head_dim=None)
    return {
        ShiftedWindowAttention: swin,
        ShiftedWindowAttentionV2: swin,
        RelativePositionalMultiHeadAttention: _Layout(qkv="to_qkv", proj="merge", heads="n_heads", head_dim="head_dim"),
    }


def _merging_types() -> tuple[type, ...]:
    from torchvision.models.swin_transformer import PatchMerging, PatchMergingV2

    return PatchMerging, PatchMergingV2


def opaque_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` that are traced opaquely and pruned by this module's functions."""
    types = tuple(_layouts()) + _merging_types()
    return [m for m in model.modules() if isinstance(m, types)]


@contextlib.contextmanager
def opaque(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """While active, each block's output is linked (for autograd) to its input by one plain step.

    The real output is computed without gradient and ``0 * input.sum()`` is
    added, so a graph tracer sees the block as one node fed by its input; how
    its channels relate is then up to the block's registered pruning function.
    """
    import torch

    def hidden(forward):
        def run(x, *args, **kwargs):
            with torch.no_grad():
                y = forward(x, *args, **kwargs)
            return y + 0 * x.sum()
        return run

    for block in blocks:
        block.forward = hidden(block.forward)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def pruners() -> dict[type, object]:
    """Block type -> torch-pruning pruning function, for every type in :func:`opaque_blocks`."""
    attention, merging = _attention_pruner_class()(), _merging_pruner_class()()
    return {**{t: attention for t in _layouts()}, **{t: merging for t in _merging_types()}}


def _attention_pruner_class():
    import torch
    import torch_pruning as tp

    class WindowAttentionPruner(tp.pruner.BasePruningFunc):
        """Remove residual channels of a window attention block and the matching per-head dims.

        In- and out-channels are the same residual channels (one function for both).
        Each head keeps the same number of dims, chosen by the L1 norm of their
        q, k and v weights, so the residual width stays ``num_heads * head_dim``.
        """

        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            layout = _layouts()[type(layer)]
            qkv, proj = getattr(layer, layout.qkv), getattr(layer, layout.proj)
            heads = getattr(layer, layout.heads)
            width = qkv.in_features
            new_width = width - len(idxs)
            if new_width <= 0 or new_width % heads:
                raise ValueError(f"cannot keep {new_width} of {width} channels in an attention block with {heads} heads")
            head_dim, new_head_dim = width // heads, new_width // heads
            dropped = set(int(i) for i in idxs)
            keep_residual = torch.tensor([i for i in range(width) if i not in dropped], device=qkv.weight.device)

            rows = qkv.weight.detach().abs().sum(1).view(3, heads, head_dim).sum(0)
            rows = rows + proj.weight.detach().abs().sum(0).view(heads, head_dim)
            kept = rows.topk(new_head_dim, dim=1).indices.sort(dim=1).values
            inner = (kept + torch.arange(heads, device=kept.device)[:, None] * head_dim).flatten()
            qkv_rows = torch.cat([inner + part * width for part in range(3)])

            select_linear(qkv, qkv_rows, keep_residual)
            select_linear(proj, keep_residual, inner)
            if layout.head_dim is not None:
                setattr(layer, layout.head_dim, new_head_dim)
            return layer

        prune_in_channels = prune_out_channels

        def get_out_channels(self, layer: nn.Module) -> int:
            return getattr(layer, _layouts()[type(layer)].qkv).in_features

        get_in_channels = get_out_channels

        def get_out_channel_groups(self, layer: nn.Module) -> int:
            return getattr(layer, _layouts()[type(layer)].heads)

        get_in_channel_groups = get_out_channel_groups

    return WindowAttentionPruner


def _merging_pruner_class():
    import torch_pruning as tp

    class PatchMergingPruner(tp.pruner.BasePruningFunc):
        """Prune Swin patch merging: input channels repeat 4 times in the concat, outputs are the projection's."""

        def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            import torch

            width = layer.reduction.in_features // 4
            dropped = set(int(i) for i in idxs)
            keep = [k * width + i for k in range(4) for i in range(width) if i not in dropped]
            cols = torch.tensor(keep, device=layer.reduction.weight.device)
            select_linear(layer.reduction, torch.arange(layer.reduction.out_features, device=cols.device), cols)
            if layer.norm.normalized_shape[0] == 4 * width:
                select_norm(layer.norm, cols)
            layer.dim = width - len(dropped)
            return layer

        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            import torch

            out = layer.reduction.out_features
            dropped = set(int(i) for i in idxs)
            rows = torch.tensor([i for i in range(out) if i not in dropped], device=layer.reduction.weight.device)
            select_linear(layer.reduction, rows, torch.arange(layer.reduction.in_features, device=rows.device))
            if layer.norm.normalized_shape[0] == out:
                select_norm(layer.norm, rows)
            return layer

        def get_in_channels(self, layer: nn.Module) -> int:
            return layer.reduction.in_features // 4

        def get_out_channels(self, layer: nn.Module) -> int:
            return layer.reduction.out_features

    return PatchMergingPruner


def shuffle_block_pruner():
    """A pruning function for ShuffleNetV2 blocks, whose output goes through a channel shuffle.

    Only a downsampling block's input can lose channels (both branches read
    all of it); a block's output, and a stride-1 block's input (split in two
    halves by the previous shuffle), keep their width. In- and out-channels
    are not tied, and no traced layer can root a group on a block's output,
    so only the input pruning is ever asked for.
    """
    import torch_pruning as tp

    fn = tp.pruner.function

    class ShuffleBlockPruner(tp.pruner.BasePruningFunc):
        def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            if len(layer.branch1) == 0:
                raise RuntimeError("a stride-1 shuffle block's input is split by a channel shuffle; it keeps its width")
            fn.prune_depthwise_conv_out_channels(layer.branch1[0], idxs)
            fn.prune_batchnorm_out_channels(layer.branch1[1], idxs)
            fn.prune_conv_in_channels(layer.branch1[2], idxs)
            fn.prune_conv_in_channels(layer.branch2[0], idxs)
            return layer

        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            raise RuntimeError("a shuffle block's output goes through a channel shuffle; it keeps its width")

        def get_in_channels(self, layer: nn.Module) -> int:
            return layer.branch1[0].in_channels if len(layer.branch1) else 2 * layer.branch2[0].in_channels

        def get_out_channels(self, layer: nn.Module) -> int:
            return 2 * layer.branch2[-3].out_channels

    return ShuffleBlockPruner()


def select_norm(norm: nn.Module, keep) -> None:
    """Keep the entries ``keep`` of a norm's weight and bias (a layer norm, or an RMS norm without a bias)."""
    from torch import nn

    norm.weight = nn.Parameter(norm.weight.detach()[keep].clone(), requires_grad=norm.weight.requires_grad)
    if getattr(norm, "bias", None) is not None:
        norm.bias = nn.Parameter(norm.bias.detach()[keep].clone(), requires_grad=norm.bias.requires_grad)
    if hasattr(norm, "normalized_shape"):
        norm.normalized_shape = (len(keep),)


def select_linear(linear: nn.Linear, rows, cols) -> None:
    """Keep output rows ``rows`` and input columns ``cols`` of a linear layer."""
    from torch import nn

    weight = linear.weight.detach()[rows][:, cols].clone()
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=linear.bias.requires_grad)
    linear.out_features, linear.in_features = weight.shape
