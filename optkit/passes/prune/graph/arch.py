"""What structured pruning must know about particular architectures.

torch-pruning follows most models from a traced autograd graph alone. A few
torchvision families need help, collected here so the pass itself stays generic:

* window attention and patch merging (Swin v1/v2, MaxViT): traced as one
  opaque node each and pruned as units by :mod:`optkit.passes.prune.graph.opaque`;
* attention found by structure: a module with a head count attribute
  (``num_heads``, ``n_heads``, ``heads``) and a fused q/k/v projection (one
  linear layer with three times the width of another's input) or separate
  q, k and v linears of equal shape. torch-pruning is given their head counts
  so every head loses the same dims, and the per-head and inner widths the
  module stores (``head_dim``-like int attributes) are written back after;
* attention whose heads are ``C // num_heads`` wide (``C`` its input width),
  or whose q/k/v layout torch-pruning cannot be told: found by structure and
  by trying it on a copy, and pruned as a unit (residual channels and every
  head's dims together) by :mod:`optkit.passes.prune.graph.attention`;
* channels-last patch merging (neighbours stacked into channels, one linear):
  found the same way and pruned as a unit by :mod:`optkit.passes.prune.graph.merging`;
* int attributes holding a child layer's width (``self.in_dim`` used in a
  reshape): written back after pruning (:mod:`optkit.passes.prune.graph.widths`);
* concatenations whose input widths torch-pruning infers wrongly or not at
  all: read from the traced graph (:mod:`optkit.passes.prune.graph.tp_fixes`);
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.graph import attention as _prune_attention
from optkit.passes.prune.graph import merging as _prune_merging
from optkit.passes.prune.graph import opaque as _prune_opaque
from optkit.passes.prune.graph import tp_fixes as _tp_fixes
from optkit.passes.prune.graph import widths as _prune_widths
from optkit.passes.prune.graph.attention import HEAD_COUNT_ATTRIBUTES

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
    widths: list[_prune_widths.WidthAttribute] = field(default_factory=list)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Context in which torch-pruning may trace the model."""
        with _prune_opaque.opaque(self.opaque), _tp_fixes.concat_sizes_from_autograd(), \
                _tp_fixes.converging_groups():
            yield

    def finish(self, model: nn.Module) -> None:
        """Write back attributes that must follow the new widths (ViT's ``hidden_dim``)."""
        from torchvision.models.vision_transformer import VisionTransformer

        for module in model.modules():
            if isinstance(module, VisionTransformer):
                module.hidden_dim = module.conv_proj.out_channels
        for block in self.attention:
            block.write_back()
        for attribute in self.widths:
            attribute.write_back()


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


def arch_support(model: nn.Module, inputs: Any = None) -> ArchSupport:
    """Collect what torch-pruning needs to know about ``model``'s architecture.

    Args:
        model: the module to be pruned.
        inputs: its example inputs; without them, attention whose head width
            follows its input width (:mod:`optkit.passes.prune.graph.attention`) is not looked for.
    """
    from torch import nn
    from torchvision.models.shufflenetv2 import InvertedResidual
    from torchvision.models.vision_transformer import VisionTransformer

    support = ArchSupport()
    blocks = _prune_opaque.opaque_blocks(model)
    inside_blocks = {sub for block in blocks for sub in block.modules()}
    attention = [a for a in find_attention(model) if a.module not in inside_blocks]
    tied = (_prune_attention.find_tied_attention(model, inputs, inside_blocks, {a.module for a in attention})
            if inputs is not None else [])
    inside_blocks |= {sub for unit in tied for sub in unit.module.modules()}
    merging = _prune_merging.find_merging(model, inputs, inside_blocks) if inputs is not None else []
    inside_blocks |= {sub for unit in merging for sub in unit.module.modules()}
    support.attention = [a for a in attention if a.module not in inside_blocks]
    support.widths = _prune_widths.width_attributes(model, inside_blocks | {a.module for a in support.attention})
    support.num_heads = {proj: block.heads for block in support.attention for proj in block.projections}
    untraced = {id(p) for m in inside_blocks for p in m.parameters(recurse=False)}  # opaque blocks hide them
    support.unwrapped_parameters = [(p, d) for p, d in unwrapped_parameters(model) if id(p) not in untraced]
    if blocks:
        support.opaque = blocks
        pruners = _prune_opaque.pruners()
        support.customized_pruners = {t: pruners[t] for t in {type(b) for b in blocks}}
    if tied:
        support.opaque = support.opaque + [unit.module for unit in tied]
        tied_pruner = _prune_attention.pruner(tied)
        support.customized_pruners.update({type(unit.module): tied_pruner for unit in tied})
        support.channel_groups.update({unit.module: unit.heads for unit in tied})
    if merging:
        support.opaque = support.opaque + [unit.module for unit in merging]
        merging_pruner = _prune_merging.pruner(merging)
        support.customized_pruners.update({type(unit.module): merging_pruner for unit in merging})
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
