"""Attention whose head width is computed from its input width, pruned as one unit.

Many attention modules reshape their q/k/v projection with the width of their
input, ``qkv(x).reshape(B, N, 3, num_heads, C // num_heads)``, instead of a
stored head size. Pruning the projections' heads on their own (torch-pruning's
``num_heads``) then breaks the forward, unless the residual width ``C`` loses
the same number of dims per head. Such a module is found by structure and by
trying it, never by its name:

* it has a head count attribute (``num_heads``-like, at least 2);
* in one forward pass, its direct child linears are called as input
  projections (input width ``C``, output ``k * C``, k = 1, 2, 3 parts of
  ``num_heads`` heads each; or another width, such as per-head kernel weights,
  whose columns alone follow ``C``) and, last, one output projection ``C -> C``;
  width-``C`` convs and norms called before the last input projection (a
  spatial reduction of keys and values) follow the residual channels, those
  called after it (a norm of the attention output) follow the head dims;
* on a copy, with its captured inputs, pruning the residual width and every
  head alike runs with the same output shape, and either pruning the heads
  alone breaks it or torch-pruning could not be told its heads (its q/k/v
  layout is not one :func:`optkit.passes.prune.graph.arch.find_attention` knows).

It is then traced as one opaque node (see :mod:`optkit.passes.prune.graph.opaque`)
whose residual channels torch-pruning prunes in ``num_heads`` equal chunks;
the pruning function here drops the same number of dims from every head
(ranked by the L1 norm of their weights) and writes back ``*dim*`` int
attributes that held the head or the residual width.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.kinds.base import call_with
from optkit.passes.prune.graph.opaque import select_linear

if TYPE_CHECKING:
    from torch import nn

HEAD_COUNT_ATTRIBUTES = ("num_heads", "n_heads", "heads", "num_head", "n_head", "nheads")


@dataclass
class TiedAttention:
    """An attention module whose heads are ``C // heads`` wide, ``C`` its input width.

    Attributes:
        module: the attention module.
        projections: (linear, parts): input projections with ``parts * C`` outputs.
        readers: linears that read the input but whose outputs are not head dims.
        proj: the output projection (``C -> C``).
        heads: the head count.
        residual_maps: width-``C`` convs and norms in the residual channels' space.
        inner_maps: width-``C`` norms in the head dims' space.
    """

    module: Any
    projections: list[tuple[Any, int]]
    readers: list[Any]
    proj: Any
    heads: int
    residual_maps: list[Any] = field(default_factory=list)
    inner_maps: list[Any] = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.proj.out_features

    def prune(self, dropped: Sequence[int], inner_only: bool = False) -> None:
        """Remove residual channels ``dropped`` and as many dims from the heads (1 per head per ``heads`` channels).

        With ``inner_only`` the residual channels stay and only the head dims go
        (the probe of whether the heads could be pruned on their own).
        """
        import torch

        width, heads = self.width, self.heads
        new_width = width - len(dropped)
        if new_width <= 0 or new_width % heads:
            raise ValueError(f"cannot keep {new_width} of {width} channels in an attention block with {heads} heads")
        head_dim, new_head_dim = width // heads, new_width // heads
        device = self.proj.weight.device
        gone = {int(i) for i in dropped}
        keep = torch.tensor([i for i in range(width) if i not in gone], device=device)
        everything = torch.arange(width, device=device)
        cols = everything if inner_only else keep
        rows = self.proj.weight.detach().abs().sum(0).view(heads, head_dim)
        for linear, parts in self.projections:
            rows = rows + linear.weight.detach().abs().sum(1).view(parts, heads, head_dim).sum(0)
        kept = rows.topk(new_head_dim, dim=1).indices.sort(dim=1).values
        inner = (kept + torch.arange(heads, device=device)[:, None] * head_dim).flatten()
        for linear, parts in self.projections:
            select_linear(linear, torch.cat([inner + part * width for part in range(parts)]), cols)
        for linear in self.readers:
            select_linear(linear, torch.arange(linear.out_features, device=device), cols)
        select_linear(self.proj, everything if inner_only else keep, inner)
        for layer in self.residual_maps:
            _select_map(layer, cols)
        for layer in self.inner_maps:
            _select_map(layer, inner)
        for name, value in list(vars(self.module).items()):
            if type(value) is int and "dim" in name:
                if value == head_dim:
                    setattr(self.module, name, new_head_dim)
                elif value == width and not (inner_only and name == "dim"):
                    # the residual width, or an inner width equal to it (``attn_dim``)
                    setattr(self.module, name, new_width)


def find_tied_attention(root: nn.Module, inputs: Any, skip: set, known: set) -> list[TiedAttention]:
    """Attention modules of ``root`` that must be pruned as units (see the module docstring).

    Args:
        root: the module to be pruned.
        inputs: its example inputs (a tensor, or a list of positional arguments).
        skip: modules already handled otherwise (they and what they contain are left out).
        known: attention modules whose heads torch-pruning can be told.

    Returns:
        the units; every instance of a unit's class in ``root`` is one, since
        torch-pruning registers pruning functions by class.
    """
    from torch import nn

    candidates = [m for m in root.modules() if m not in skip and not isinstance(m, nn.MultiheadAttention)
                  and _heads(m) >= 2 and any(isinstance(c, nn.Linear) for c in m.children())]
    if not candidates:
        return []
    calls = capture_calls(root, inputs, candidates)
    if not calls:
        return []
    units = {module: _unit(module, calls[module]) for module in candidates}
    by_type: dict[type, list] = {}
    for module in root.modules():
        if module not in skip:
            by_type.setdefault(type(module), []).append(module)
    found = []
    for members in by_type.values():
        tied = [units.get(m) for m in members]
        if (tied[0] is not None and all(unit is not None for unit in tied)
                and _probe(tied[0], calls[members[0]], members[0] in known)):
            found.extend(tied)
    inside = {sub for unit in found for sub in unit.module.modules() if sub is not unit.module}
    return [unit for unit in found if unit.module not in inside]


def _heads(module: nn.Module) -> int:
    return next((v for a in HEAD_COUNT_ATTRIBUTES if type(v := getattr(module, a, None)) is int), 0)


def capture_calls(root: nn.Module, inputs: Any, modules: Sequence[nn.Module]) -> dict[Any, dict]:
    """Run ``root`` once and record, per module, its first call and the order its direct children are called in.

    Returns:
        module -> ``{"call": (args, kwargs, output), "children": [child, ...]}``
        (children with parameters only; ``"call"`` missing if it did not run).
        Empty if the forward pass raises.
    """
    import torch

    calls: dict[Any, dict] = {m: {"children": []} for m in modules}
    hooks = []
    for module in modules:
        hooks.append(module.register_forward_hook(_capture(calls[module]), with_kwargs=True))
        for child in module.children():
            if any(True for _ in child.parameters()):
                hooks.append(child.register_forward_pre_hook(_called(calls[module]["children"], child)))
    was_training = root.training
    try:
        root.eval()
        with torch.no_grad():
            call_with(root, inputs)
    except Exception:
        return {}
    finally:
        root.train(was_training)
        for hook in hooks:
            hook.remove()
    return calls


def _capture(record: dict):
    def hook(module, args, kwargs, output):
        record.setdefault("call", (args, kwargs, output))
    return hook


def _called(order: list, child: nn.Module):
    def hook(module, args):
        if child not in order:
            order.append(child)
    return hook


def _unit(module: nn.Module, record: dict) -> TiedAttention | None:
    import torch
    from torch import nn

    linears = [c for c in record["children"] if isinstance(c, nn.Linear)]
    if "call" not in record or len(linears) < 2:
        return None
    args, _, output = record["call"]
    if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    width, heads = args[0].shape[-1], _heads(module)
    *inputs, proj = linears
    if (proj.in_features, proj.out_features) != (width, width) or width % heads or output.shape[-1] != width:
        return None
    inputs = [lin for lin in inputs if lin.in_features == width]  # others (relative positions) are left as they are
    projections = [(lin, lin.out_features // width) for lin in inputs if lin.out_features % width == 0]
    readers = [lin for lin in inputs if lin.out_features % width]
    if sum(parts for _, parts in projections) < 2:
        return None
    last_input = record["children"].index(inputs[-1])
    maps = [(i, c) for i, c in enumerate(record["children"]) if not isinstance(c, nn.Linear)]
    if any(_map_width(c) != width for _, c in maps):
        return None
    return TiedAttention(module, projections, readers, proj, heads,
                         residual_maps=[c for i, c in maps if i < last_input],
                         inner_maps=[c for i, c in maps if i > last_input])


def _map_width(layer: nn.Module) -> int | None:
    """The width of a conv mapping ``C`` to ``C`` channels (plain or depthwise) or a norm over ``C``, else ``None``."""
    from torch import nn

    if isinstance(layer, nn.modules.conv._ConvNd):
        plain = layer.groups == 1 or layer.groups == layer.in_channels
        return layer.in_channels if plain and layer.in_channels == layer.out_channels else None
    if isinstance(layer, nn.LayerNorm) and len(layer.normalized_shape) == 1:
        return layer.normalized_shape[0]
    if isinstance(layer, nn.modules.batchnorm._BatchNorm | nn.GroupNorm) and layer.weight is not None:
        return layer.weight.shape[0] if not isinstance(layer, nn.GroupNorm) or layer.num_groups == 1 else None
    return None


def _probe(unit: TiedAttention, record: dict, known: bool) -> bool:
    """Whether ``unit``'s module runs pruned as a unit and (when its heads are ``known``) not with the heads alone."""
    args, kwargs, output = record["call"]
    x = args[0]
    dropped = list(range(unit.width - unit.heads, unit.width))
    if known and _runs(unit, dropped, True, (x, *args[1:]), kwargs, output.shape):
        return False
    shape = (*output.shape[:-1], unit.width - unit.heads)
    return _runs(unit, dropped, False, (x[..., : unit.width - unit.heads], *args[1:]), kwargs, shape)


def _runs(unit: TiedAttention, dropped: list[int], inner_only: bool, args: tuple, kwargs: dict, shape) -> bool:
    import torch

    trial = copy.deepcopy(unit)  # copies the module, and the layers the unit names inside it, together
    try:
        trial.prune(dropped, inner_only)
        with torch.no_grad():
            out = trial.module(*args, **kwargs)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.shape == shape


def pruner(units: Sequence[TiedAttention]):
    """A torch-pruning pruning function for the classes of ``units`` (each instance looked up by identity)."""
    import torch_pruning as tp

    by_module = {id(unit.module): unit for unit in units}

    class TiedAttentionPruner(tp.pruner.BasePruningFunc):
        """Residual channels in and out are the same channels (one function for both)."""

        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            by_module[id(layer)].prune(idxs)
            return layer

        prune_in_channels = prune_out_channels

        def get_out_channels(self, layer: nn.Module) -> int:
            return by_module[id(layer)].width

        get_in_channels = get_out_channels

    return TiedAttentionPruner()


def _select_map(layer: nn.Module, keep) -> None:
    """Keep channels ``keep`` of a conv (inputs and outputs) or a norm."""
    from torch import nn

    def take(param, *dims):
        if param is None:
            return None
        value = param.detach()
        for dim in dims:
            value = value.index_select(dim, keep)
        return nn.Parameter(value.clone(), requires_grad=param.requires_grad)

    width = len(keep)
    if isinstance(layer, nn.modules.conv._ConvNd):
        depthwise = layer.groups == layer.in_channels and layer.groups > 1
        layer.weight = take(layer.weight, 0) if depthwise else take(layer.weight, 0, 1)
        layer.bias = take(layer.bias, 0)
        layer.in_channels = layer.out_channels = width
        if depthwise:
            layer.groups = width
    elif isinstance(layer, nn.LayerNorm):
        layer.weight, layer.bias = take(layer.weight, 0), take(layer.bias, 0)
        layer.normalized_shape = (width,)
    else:
        layer.weight, layer.bias = take(layer.weight, 0), take(layer.bias, 0)
        if isinstance(layer, nn.GroupNorm):
            layer.num_channels = width
        else:
            layer.num_features = width
            for name in ("running_mean", "running_var"):
                if getattr(layer, name) is not None:
                    setattr(layer, name, getattr(layer, name).index_select(0, keep).clone())
