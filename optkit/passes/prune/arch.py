"""What structured pruning must know about particular architectures.

torch-pruning follows most models from a traced autograd graph alone. A few
torchvision families need help, collected here so the pass itself stays generic:

* window attention and patch merging (Swin v1/v2, MaxViT): traced as one
  opaque node each and pruned as units by :mod:`optkit.passes.prune.opaque`;
* attention found by structure: a module with a head count attribute
  (``num_heads``, ``n_heads``, ``heads``) and a fused q/k/v projection (one
  linear layer with three times the width of another's input) or separate
  q, k and v linears of equal shape. torch-pruning is given their head counts
  so every head loses the same dims, and the per-head and inner widths the
  module stores (``head_dim``-like int attributes) are written back after;
* bare ``nn.Parameter``s used in forward (layer scale, position embeddings,
  class tokens): given to torch-pruning as unwrapped parameters, each with
  the dim that matches a layer width as its channel dim;
* ``nn.MultiheadAttention`` (ViT): pruned per head group, with the class token
  and position embedding pruned along and ``hidden_dim`` written back;
* channel shuffle (ShuffleNetV2): a channel permutation torch-pruning cannot
  map, so each shuffle block is traced as a unit that keeps its output width
  (a downsampling block's input may shrink), and its ``branch2`` (whose inner
  channels do not cross a shuffle) is pruned on its own;
* grouped convolutions torch-pruning 1.6.1 breaks on (a depthwise conv with a
  channel multiplier, one output channel per group, a grouped conv fed by a
  concatenation): held at full width, with the layers that feed them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.passes.prune import opaque as _prune_opaque

if TYPE_CHECKING:
    from torch import nn

SHUFFLE_REASON = ("a channel shuffle block keeps its output width (and a stride-1 block its input width): "
                  "the shuffle is a permutation torch-pruning cannot follow")


@dataclass
class ArchSupport:
    """Extra torch-pruning settings and fix-ups for one model.

    Attributes:
        opaque: modules traced as a single channel-preserving node.
        customized_pruners: module type -> torch-pruning pruning function.
        unwrapped_parameters: (parameter, dim) pairs torch-pruning prunes along the channel dim.
        channel_groups: module -> number of channel groups pruned alike (attention heads).
        fixed: module name -> why its output channels must keep their width.
        subgraphs: names of sub-modules pruned on their own afterwards, keeping
            their input and output widths.
    """

    opaque: list[Any] = field(default_factory=list)
    customized_pruners: dict[type, Any] = field(default_factory=dict)
    unwrapped_parameters: list[tuple[Any, int]] = field(default_factory=list)
    channel_groups: dict[Any, int] = field(default_factory=dict)
    fixed: dict[str, str] = field(default_factory=dict)
    subgraphs: list[str] = field(default_factory=list)
    num_heads: dict[Any, int] = field(default_factory=dict)
    attention: list[_Attention] = field(default_factory=list)

    def tracing(self) -> contextlib.AbstractContextManager:
        """Context in which torch-pruning may trace the model."""
        return _prune_opaque.opaque(self.opaque)

    def finish(self, model: nn.Module) -> None:
        """Write back attributes that must follow the new widths (ViT's ``hidden_dim``)."""
        from torchvision.models.vision_transformer import VisionTransformer

        for module in model.modules():
            if isinstance(module, VisionTransformer):
                module.hidden_dim = module.conv_proj.out_channels
        for block in self.attention:
            block.write_back()


HEAD_COUNT_ATTRIBUTES = ("num_heads", "n_heads", "heads")


@dataclass
class _Attention:
    """An attention module found by structure, and the widths it stored before pruning."""

    module: Any
    projections: list[Any]
    parts: int  # 3 for a fused q/k/v projection, 1 for separate ones
    heads: int
    head_dim: int

    def write_back(self) -> None:
        new_head_dim = self.projections[0].out_features // (self.parts * self.heads)
        if new_head_dim == self.head_dim:
            return
        inner, new_inner = self.heads * self.head_dim, self.heads * new_head_dim
        for name, value in list(vars(self.module).items()):
            if type(value) is not int or "dim" not in name:
                continue
            if value == self.head_dim:
                setattr(self.module, name, new_head_dim)
            elif value == inner and name != "dim":
                setattr(self.module, name, new_inner)


def find_attention(model: nn.Module) -> list[_Attention]:
    """Attention modules of ``model`` found by structure (see the module docstring)."""
    from torch import nn

    found = []
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            continue
        heads = next((v for a in HEAD_COUNT_ATTRIBUTES if type(v := getattr(module, a, None)) is int), 0)
        if heads < 2:
            continue
        linears = [c for c in module.children() if isinstance(c, nn.Linear)]
        inputs = {lin.in_features for lin in linears}
        fused = [lin for lin in linears if lin.out_features % (3 * heads) == 0 and lin.out_features // 3 in inputs]
        if len(fused) == 1:
            found.append(_Attention(module, fused, 3, heads, fused[0].out_features // (3 * heads)))
            continue
        shapes: dict[tuple[int, int], list] = {}
        for lin in linears:
            shapes.setdefault((lin.in_features, lin.out_features), []).append(lin)
        separate = [group for (_, out), group in shapes.items() if len(group) == 3 and out % heads == 0]
        if len(separate) == 1:
            found.append(_Attention(module, separate[0], 1, heads, separate[0][0].out_features // heads))
    return found


def arch_support(model: nn.Module) -> ArchSupport:
    """Collect what torch-pruning needs to know about ``model``'s architecture."""
    from torch import nn
    from torchvision.models.shufflenetv2 import InvertedResidual
    from torchvision.models.vision_transformer import VisionTransformer

    support = ArchSupport()
    blocks = _prune_opaque.opaque_blocks(model)
    inside_blocks = {sub for block in blocks for sub in block.modules()}
    support.attention = [a for a in find_attention(model) if a.module not in inside_blocks]
    support.num_heads = {proj: block.heads for block in support.attention for proj in block.projections}
    support.unwrapped_parameters = unwrapped_parameters(model)
    if blocks:
        support.opaque = blocks
        pruners = _prune_opaque.pruners()
        support.customized_pruners = {t: pruners[t] for t in {type(b) for b in blocks}}
    for name, module in model.named_modules():
        if isinstance(module, VisionTransformer):
            explicit = {id(module.class_token): 2, id(module.encoder.pos_embedding): 2}
            support.unwrapped_parameters = [(p, explicit.get(id(p), d)) for p, d in support.unwrapped_parameters]
        elif isinstance(module, nn.MultiheadAttention):
            support.channel_groups[module] = module.num_heads
        elif isinstance(module, InvertedResidual):
            support.opaque.append(module)
            support.customized_pruners[InvertedResidual] = _prune_opaque.shuffle_block_pruner()
            support.fixed[name] = SHUFFLE_REASON
            support.subgraphs.append(f"{name}.branch2")
    return support


def unwrapped_parameters(model: nn.Module) -> list[tuple[Any, int]]:
    """Bare parameters used in forward (layer scale, position embeddings, class tokens), each with its channel dim.

    torch-pruning prunes such a parameter along its last dim longer than 1,
    which is wrong for a channels-first one (a ``(1, C, H, W)`` position
    embedding). The channel dim is taken to be the one whose length is the
    width of some conv or linear layer (the last such dim if several are).
    A parameter with no such dim is left to torch-pruning's default.
    """
    import torch_pruning as tp
    from torch import nn

    known = set(tp.pruner.function.PrunerBox)
    widths = set()
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            widths.update((module.in_channels, module.out_channels))
        elif isinstance(module, nn.Linear):
            widths.update((module.in_features, module.out_features))
    found = []
    for module in model.modules():
        kind = tp.ops.module2type(module)
        if kind in known and kind != tp.ops.OPTYPE.ELEMENTWISE:
            continue
        for param in module.parameters(recurse=False):
            sizes = [(i, n) for i, n in enumerate(param.shape) if n > 1]
            channel = [i for i, n in sizes if n in widths]
            if channel:
                found.append((param, channel[-1]))
            elif sizes:
                found.append((param, sizes[-1][0]))
    return found


def unprunable_grouped_convs(graph: Any) -> dict[Any, str]:
    """Grouped convolutions torch-pruning 1.6.1 cannot prune, each with the reason.

    It crashes on, or leaves mismatched widths around, a depthwise conv with a
    channel multiplier (``groups == in_channels != out_channels``), a grouped
    conv with one output channel per group (``groups == out_channels != in_channels``)
    and a grouped conv whose input channels come from a concatenation.

    Args:
        graph: the torch-pruning dependency graph of the model.
    """
    import torch_pruning as tp
    from torch import nn

    found: dict[Any, str] = {}
    for module in graph.module2node:
        if not isinstance(module, nn.modules.conv._ConvNd) or module.groups == 1:
            continue
        groups, cin, cout = module.groups, module.in_channels, module.out_channels
        if groups == cin and cout != cin:
            found[module] = f"a depthwise conv with a channel multiplier ({cin} -> {cout}), which torch-pruning cannot prune"
        elif groups == cout and cin != cout:
            found[module] = f"a grouped conv with one output channel per group ({groups} groups), which torch-pruning cannot prune"
        elif groups < cin and any(node.type == tp.ops.OPTYPE.CONCAT
                                  for dep, _ in input_group(graph, module) for node in (dep.source, dep.target)):
            found[module] = "a grouped conv fed by a concatenation, which torch-pruning cannot prune"
    return found


def input_group(graph: Any, module: nn.Module) -> Any:
    """The torch-pruning group that removing ``module``'s input channels would prune."""
    pruner = graph.get_pruner_of_module(module)
    return graph.get_pruning_group(module, pruner.prune_in_channels, list(range(pruner.get_in_channels(module))))
