"""Turn a block's traced calls into attention, MLP and expert units, layouts checked by permutation."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from optkit.passes.prune.hf.structure import Attention, Block, Experts, Layer, Mlp


def parse_block(block: Block, calls: list[tuple[Layer, torch.Tensor]], hidden: int,
                heads: int, kv_heads: int, head_dim: int, *, like: Block | None = None) -> None:
    """Fill ``block``'s units from its calls; what cannot be described goes to ``block.skipped``.

    ``like``: a block of the same class already parsed and checked; its units' layouts are taken instead of
    checking them again by permutation (head norms are still found in this block).
    """
    pending: list[Layer] = []
    for layer, _ in calls:
        if layer.out_dim == hidden and layer.in_dim == heads * head_dim:
            # The weights decide when a config's KV head count does not apply to this class (plain MHA).
            attention = _attention(pending, layer, hidden, heads, kv_heads, head_dim) or \
                _attention(pending, layer, hidden, heads, heads, head_dim)
            if attention is not None:
                block.attentions.append(attention)
                pending = []
                continue
        # A square layer is read as an output projection only: an MLP as wide as the residual is not told apart.
        if layer.out_dim == hidden and layer.in_dim != hidden and pending:
            mlp = _mlp(pending, layer, hidden)
            if mlp is not None:
                block.mlps.append(mlp)
                pending = []
                continue
        pending.append(layer)
    block.experts = _experts(block.module, hidden)
    if block.call is None:
        block.skipped.append(f"{block.path}: not called by the example inputs")
        block.attentions, block.mlps, block.experts = [], [], []
        return
    if like is None:
        _check_layouts(block)
    else:
        _take_layouts(block, like)
    if not block.attentions and not block.bound:
        block.skipped.append(f"{block.path}: no attention with {heads} heads x {head_dim} (q/k/v -> output) found")
    if not block.mlps and not block.experts:
        block.skipped.append(f"{block.path}: no MLP (expansion -> projection to {hidden}) found")


def _attention(pending: list[Layer], o: Layer, hidden: int, heads: int, kv: int, d: int) -> Attention | None:
    reads = [layer for layer in pending if layer.in_dim == hidden]
    fused = [layer for layer in reads if layer.out_dim == (heads + 2 * kv) * d]
    if fused:
        return Attention([fused[-1]], o, heads, kv, d, layout="blocks")
    q = [layer for layer in reads if layer.out_dim == heads * d]
    kv_layers = [layer for layer in reads if layer.out_dim == kv * d and layer not in q[-1:]]
    if q and len(kv_layers) >= 2:
        qkv = sorted({id(x): x for x in [q[-1], *kv_layers[-2:]]}.values(), key=pending.index)
        if len(qkv) == 3:
            return Attention(qkv, o, heads, kv, d)
    return None


def _mlp(pending: list[Layer], down: Layer, hidden: int) -> Mlp | None:
    reads = [layer for layer in pending if layer.in_dim == hidden]
    fused = [layer for layer in reads if layer.out_dim == 2 * down.in_dim]
    if fused:
        return Mlp([fused[-1]], down, parts=2)
    ups = [layer for layer in reads if layer.out_dim == down.in_dim][-2:]
    return Mlp(ups, down) if ups else None


def _experts(block: nn.Module, hidden: int) -> list[Experts]:
    found = []
    for name, module in block.named_modules():
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
        for down in (n for n, p in params.items() if p.shape[1] == hidden):
            e, _, width = params[down].shape
            ups = [n for n, p in params.items() if n != down and p.shape[0] == e and p.shape[2] == hidden]
            parts = {params[n].shape[1] // width for n in ups if params[n].shape[1] % width == 0}
            if ups and len(parts) == 1:
                found.append(Experts(module, name, ups, down, parts.pop()))
                break
    return found


def _attach_head_norms(block: Block) -> None:
    """Give each separate-projection attention the norms whose input is the whole output tensor of one of its
    q/k/v projections (a norm over all heads at once), found in one run of the block."""
    layers = {id(layer.module): (attention, layer) for attention in block.attentions if attention.layout == "separate"
              for layer in attention.qkv}
    if not layers:
        return
    outputs: dict[int, tuple] = {}

    def projected(module, args, output):
        outputs[id(output)] = (*layers[id(module)], output)  # held, so that no later tensor reuses the id

    def normed(module, args):
        owner = outputs.get(id(args[0])) if args else None
        if owner is not None and module.weight.shape[0] == args[0].shape[-1]:
            attention, layer, _ = owner
            if all(norm is not module for norm, _ in attention.norms):
                attention.norms.append((module, layer))

    modules = {id(m): m for m in block.module.modules()}
    hooks = [modules[key].register_forward_hook(projected) for key in layers]
    hooks += [m.register_forward_pre_hook(normed) for m in block.module.modules()
              if not isinstance(m, nn.Linear | nn.Embedding) and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dim() == 1]
    try:
        _run(block)
    finally:
        for hook in hooks:
            hook.remove()


def _take_layouts(block: Block, like: Block) -> None:
    """Give ``block``'s units the layouts ``like``'s units were found to have (same class, same order)."""
    if (len(block.attentions), len(block.mlps), len(block.experts)) != \
            (len(like.attentions), len(like.mlps), len(like.experts)):
        return  # the caller compares the units and refuses
    for attention, checked in zip(block.attentions, like.attentions, strict=True):
        attention.layout, attention.roles = checked.layout, checked.roles
        if checked.head_params:
            attention.head_params = _head_params(block, attention)
    for unit, checked in zip([*block.mlps, *block.experts], [*like.mlps, *like.experts], strict=True):
        unit.interleaved = checked.interleaved
    if any(attention.norms for attention in like.attentions):
        _attach_head_norms(block)


def _check_layouts(block: Block) -> None:
    """Keep units whose layout survives a permutation of heads/channels; try the other layouts first."""
    _attach_head_norms(block)
    baseline = _run(block)
    kept = []
    for attention in block.attentions:
        layouts = ["blocks", "grouped"] if attention.layout != "separate" else ["separate"]
        if _first_invariant(block, baseline, attention, layouts, _permute_heads, "layout"):
            kept.append(attention)
        elif _bound(block, baseline, attention, layouts):
            (block.bound if attention.shared or attention.fixed else kept).append(attention)
        else:
            block.skipped.append(f"{block.path}: attention at {attention.o.name}: no q/k/v layout keeps the output "
                                 "when heads are permuted")
    block.attentions = kept
    for kind, units in (("MLP", block.mlps), ("experts", block.experts)):
        good = []
        for unit in units:
            options = [False, True] if unit.parts > 1 else [False]
            if _first_invariant(block, baseline, unit, options, _permute_channels, "interleaved"):
                good.append(unit)
            else:
                where = unit.down.name if isinstance(unit, Mlp) else unit.name
                block.skipped.append(f"{block.path}: {kind} at {where}: its output changes when channels are permuted")
        units[:] = good


def _bound(block: Block, baseline: torch.Tensor, attention: Attention, layouts: list[str]) -> bool:
    """Whether ``attention``'s heads are indexed beside its projections, and how (its layout found on the way).

    Heads permute freely once per-head parameters beside the projections (Nystromformer's per-head conv) and the
    block's inputs with a head axis (a position bias computed once for every block: MPNet) are permuted with
    them. Otherwise, where only permuting the dims inside every head keeps the output (ALiBi: each head's bias
    follows from its position and the head count), the heads are ``fixed``: their dims may narrow, no head goes.
    """
    attention.head_params, attention.shared = _head_params(block, attention), _head_inputs(block, attention)
    if attention.head_params or attention.shared:
        for layout in layouts:
            attention.layout = layout
            if _invariant(block, baseline, lambda: _permute_heads_and_inputs(block, attention)):
                return True
    attention.head_params, attention.shared = [], []
    attention.fixed = dims_permute_freely(block, attention, layouts, baseline)
    return attention.fixed


def dims_permute_freely(block: Block, attention: Attention, layouts: list[str] | None = None,
                        baseline: torch.Tensor | None = None) -> bool:
    """Whether permuting the dims inside every head (the query/key dims one way, the value/output dims another)
    leaves the block's output as it was, for one of ``layouts`` (the attention's own by default), whose layout
    and projection roles are then set. Not so where dims are paired (rotary position embeddings)."""
    if block.call is None:
        return False
    baseline = _run(block) if baseline is None else baseline
    for layout in layouts or [attention.layout]:
        attention.layout = layout
        options = [None] if layout != "separate" else [None, *itertools.permutations(range(len(attention.qkv)))]
        for roles in options:
            attention.roles = roles
            if _invariant(block, baseline, lambda: _permute_dims(attention)):
                return True
    attention.roles = None
    return False


def _head_params(block: Block, attention: Attention) -> list[tuple[nn.Module, str, int]]:
    """Parameters beside the projections (and their norms) in the module holding them all, with an axis as long
    as the head count: ``(module, name, axis)``."""
    layers = {id(layer.module) for layer in attention.layers()} | {id(norm) for norm, _ in attention.norms}
    names = {id(m): n for n, m in block.module.named_modules()}
    paths = [names[i].split(".") for i in layers if i in names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    owner = block.module.get_submodule(".".join(common)) if common else block.module
    found = []
    for module in owner.modules():
        if id(module) in layers:
            continue
        for name, param in module.named_parameters(recurse=False):
            axes = [i for i, size in enumerate(param.shape) if size == attention.heads]
            if axes and attention.heads > 1:
                found.append((module, name, axes[0]))
    return found


def _head_inputs(block: Block, attention: Attention) -> list[tuple[int | str, int]]:
    """The block's float inputs (not the residual stream) with an axis as long as the head count: ``(argument
    index or keyword, axis)``."""
    args, kwargs = block.call
    found = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2
                and value.shape[-1] != attention.o.out_dim and attention.heads > 1):
            axes = [i for i, size in enumerate(value.shape) if size == attention.heads]
            if axes:
                found.append((key, axes[0]))
    return found


def _permute_heads_and_inputs(block: Block, attention: Attention) -> None:
    """Reverse the heads (:func:`_permute_heads`, per-head parameters with them) and the block's per-head inputs."""
    _permute_heads(attention)
    args, kwargs = list(block.call[0]), dict(block.call[1])
    for key, axis in attention.shared:
        if isinstance(key, int):
            args[key] = args[key].flip(axis)
        else:
            kwargs[key] = kwargs[key].flip(axis)
    block.call = (tuple(args), kwargs)


def _permute_dims(attention: Attention) -> None:
    """Reverse the dims inside every query/key head and rotate them inside every value/output head."""
    d, kv = attention.head_dim, attention.kv_heads
    qk, vo = torch.arange(d - 1, -1, -1), torch.roll(torch.arange(d), 1)
    attention.select(*attention.every(), dims=([qk] * kv, [vo] * kv))


def _invariant(block: Block, baseline: torch.Tensor, change: Callable[[], None]) -> bool:
    """Whether the block's output is unchanged after ``change`` (its parameters and inputs are put back)."""
    saved, call = _save(block.module), block.call
    try:
        change()
        return _close(_run(block), baseline)
    except (RuntimeError, IndexError):
        return False
    finally:
        _restore(saved)
        block.call = call


def _first_invariant(block: Block, baseline: torch.Tensor, unit, options: list, permute: Callable, attr: str) -> bool:
    for option in options:
        setattr(unit, attr, option)
        saved = _save(block.module)
        try:
            permute(unit)
            same = _close(_run(block), baseline)
        except (RuntimeError, IndexError):
            same = False
        finally:
            _restore(saved)
        if same:
            return True
    return False


def _permute_heads(attention: Attention) -> None:
    """Reverse the KV groups and the q heads inside each group (not the identity unless one head)."""
    heads, kv_heads = attention.heads, attention.kv_heads
    attention.select(list(range(kv_heads))[::-1], [list(range(attention.groups))[::-1]] * kv_heads)
    attention.heads, attention.kv_heads = heads, kv_heads


def _permute_channels(unit: Mlp | Experts) -> None:
    reverse = torch.arange(unit.width - 1, -1, -1)
    if isinstance(unit, Mlp):
        unit.select(reverse)
    else:
        unit.select(reverse.expand(getattr(unit.module, unit.down).shape[0], -1))


def _save(module: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Parameter]]:
    return {f"{id(m)}.{n}": (m, n, p) for m in module.modules() for n, p in m.named_parameters(recurse=False)}


def _restore(saved: dict) -> None:
    for owner, name, param in saved.values():
        setattr(owner, name, param)


def _run(block: Block) -> torch.Tensor:
    with torch.no_grad():
        return block.run().detach().clone()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-4 * (1 + b.abs().max().item()), rtol=1e-4)
