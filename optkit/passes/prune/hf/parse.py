"""Turn a block's traced calls into attention, MLP and expert units, layouts checked by permutation."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from optkit.passes.prune.hf.structure import Attention, Block, Experts, Layer, Mlp


def parse_block(block: Block, calls: list[tuple[Layer, torch.Tensor]], hidden: int,
                heads: int, kv_heads: int, head_dim: int) -> None:
    """Fill ``block``'s units from its calls; what cannot be described goes to ``block.skipped``."""
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
    _check_layouts(block)
    if not block.attentions:
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


def _check_layouts(block: Block) -> None:
    """Keep units whose layout survives a permutation of heads/channels; try the other layouts first."""
    _attach_head_norms(block)
    baseline = _run(block)
    kept = []
    for attention in block.attentions:
        layouts = ["blocks", "grouped"] if attention.layout != "separate" else ["separate"]
        if _first_invariant(block, baseline, attention, layouts, _permute_heads, "layout"):
            kept.append(attention)
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
