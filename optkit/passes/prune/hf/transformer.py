"""Prune a Hugging Face transformer to uniform widths (heads, MLP channels, hidden size) and depth, in place.

Every change is tried against the stock class: after the weights are cut and the
config updated, the class is built from the new config on the meta device and
every parameter's name and shape must match; the fresh model's scalar module
attributes (head counts, ``layer_idx``, ...) are copied over. A change the
stock config cannot describe is undone and reported.

Where the stock class derives the head width from ``hidden_size / num_heads``
(fewer heads alone are refused), the hidden size shrinks with the heads so the
head width stays (:mod:`.hidden`); elsewhere it shrinks only when asked, or when
the stock class fixes the heads or the MLP width (a per-head bias that follows
each head's position, an MLP of 4x the hidden size): the residual stream is then
narrowed until the parameters reach what the ratios would have removed, the
widths the class derives from it (the MLP, every head's dims) following.

Heads indexed by an input every block is given (a relative-position bias computed
once) go from every block alike, chosen by their scores summed over the blocks,
and the tensors outside the blocks with a head axis (the bias table, a head that
reads every block's attention maps) lose the same heads.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from optkit.core.errors import OptkitError, first_line
from optkit.passes.prune.hf import depth
from optkit.passes.prune.hf import hidden as hidden_size
from optkit.passes.prune.hf.importance import Activations, channel_scores, dim_scores, expert_scores, head_scores
from optkit.passes.prune.hf.parse import dims_permute_freely, parse_block
from optkit.passes.prune.hf.structure import (
    HEAD_FIELDS, HIDDEN_FIELDS, KV_FIELDS, LAYER_FIELDS, Block, Mlp, config_int, find_block_lists, run_hooked,
    trace,
)

# _commit with the example inputs bound
Commit = Callable[..., bool]
WIDTH_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                "d_ff", "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def prune_transformer(model: nn.Module, *, heads_ratio: float = 0.0, mlp_ratio: float = 0.0, drop_blocks: int = 0,
                      example_inputs: dict[str, Any] | None = None, activations: Activations = None,
                      round_to: int = 8, hidden_ratio: float | None = None) -> dict[str, Any]:
    """Remove attention heads, MLP channels, hidden channels and whole blocks; the stock class still describes it.

    Args:
        model: a Hugging Face model (has ``config``, blocks in a ``ModuleList``); changed in place.
        heads_ratio: share of heads to remove in every block (whole KV groups with
            grouped-query attention, query heads per group with multi-query attention).
        mlp_ratio: share of MLP (and per-expert) channels to remove in every block;
            the kept width is rounded to a multiple of ``round_to`` unless that removes nothing.
        drop_blocks: number of blocks to remove, those whose output is most similar
            (cosine) to their input on ``example_inputs``.
        example_inputs: keyword inputs for ``model(**example_inputs)``; random tokens
            (or images) sized from the config when omitted.
        activations: optional per-layer input-channel norms (layer name -> tensor) for
            activation-aware importance; weight L2 norms when omitted.
        round_to: multiple the kept MLP width (and a hidden size set by ``hidden_ratio``) is rounded to.
        hidden_ratio: share of the residual stream's channels to remove. ``None`` (default): with the
            heads, in classes whose head width is ``hidden / heads`` (the hidden size then shrinks in
            proportion, so the head width stays); and, in a prune of the MLP too (``mlp_ratio`` > 0)
            where the stock class refuses fewer heads or a narrower MLP, as far as the parameters need to
            reach what ``heads_ratio`` and ``mlp_ratio`` would have removed (at most ``max(heads_ratio,
            mlp_ratio)`` of the stream). ``0``: never, so such classes keep their heads. In a class whose
            head width is free, a share prunes the stream on its own.

    Returns:
        ``{"before": {...}, "after": {...}, "dropped_blocks": [...], "skipped": [...]}``; the
        summaries hold heads, kv_heads, intermediate widths, hidden size, layers and params; each
        skipped entry is one line naming a part left whole and why (and where the hidden size was narrowed
        instead, one line saying so).

    Raises:
        OptkitError: a ratio outside [0, 1), a config without head counts, or a model
            whose blocks cannot be run on the example inputs.
    """
    ratios = (("heads_ratio", heads_ratio), ("mlp_ratio", mlp_ratio), ("hidden_ratio", hidden_ratio or 0.0))
    for name, value in ratios:
        if not 0.0 <= value < 1.0:
            raise OptkitError(f"{name} must be in [0, 1), got {value}; pass a share of units to remove such as 0.25")
    config = model.config
    hidden, heads = config_int(config, HIDDEN_FIELDS), config_int(config, HEAD_FIELDS)
    if hidden is None or heads is None:
        raise OptkitError("the model's config has no int hidden size or head count "
                          f"(looked for {HIDDEN_FIELDS} and {HEAD_FIELDS}); only such transformers can be pruned")
    inputs = example_inputs if example_inputs is not None else _default_inputs(model)
    was_training = model.training
    model.eval()
    skipped: list[str] = []
    before = _summary(model, [])
    commit = functools.partial(_commit, inputs=inputs)
    dropped = depth.drop(model, drop_blocks, inputs, commit) if drop_blocks else []
    blocks = _find(model, inputs, hidden, heads, skipped)
    stream = _stream(blocks, hidden)
    target = _params(model) - heads_ratio * _unit_params(blocks, "attention") - mlp_ratio * _unit_params(blocks, "mlp")
    shape = _unit_shape(blocks)
    if heads_ratio > 0:
        _prune_heads(model, blocks, heads_ratio, activations, skipped, stream, hidden_ratio != 0, commit, inputs)
    if mlp_ratio > 0:
        _prune_mlps(model, blocks, mlp_ratio, round_to, activations, skipped, commit)
    if hidden_ratio:
        _prune_hidden(model, blocks, hidden, kept_width(hidden, hidden_ratio, round_to), stream, skipped, commit)
    elif hidden_ratio is None and mlp_ratio > 0 and config_int(model.config, HIDDEN_FIELDS) == hidden and \
            _params(model) > target + 0.02 * before["params"] and _refused(blocks, shape, heads_ratio, mlp_ratio):
        _hidden_to_reach(model, blocks, hidden, int(target), max(heads_ratio, mlp_ratio), round_to, stream,
                         activations, skipped, commit)
    model.train(was_training)
    return {"before": before, "after": _summary(model, blocks), "dropped_blocks": dropped, "skipped": skipped}


def heads_with_stream(model: nn.Module, spec: Any, widths: Any, details: dict[str, Any]) -> dict[str, Any]:
    """Finish a block-by-block prune (:mod:`.entry`'s ``details``) that kept every head because the stock class
    takes fewer heads only with a narrower stream (hidden a multiple of the head count): the heads go here, in
    place, with the hidden size and what reads every block's heads (ESM's contact head). ``spec`` and ``widths``
    are the prune's ``PruneSpec`` and ``Widths``. Returns ``details``, updated when heads went."""
    from optkit.passes.prune.hf.calibration import calibration_text, example_keywords

    result = details.get("transformer") or {}
    heads_ratio = widths.ratio if widths.heads_ratio is None else widths.heads_ratio
    if result.get("engine") != "blockwise" or heads_ratio <= 0 or spec.drop_blocks or \
            result["after"]["heads"] != result["before"]["heads"]:
        return details
    activations = None
    if spec.importance == "activation":
        from optkit.passes.prune.hf.calibration import input_norms

        batches = calibration_text(model, spec)
        activations = input_norms(model, batches) if batches is not None else None
    done = prune_transformer(model, heads_ratio=heads_ratio, example_inputs=example_keywords(model, spec),
                             round_to=widths.round_to, activations=activations)
    if done["after"]["heads"] == done["before"]["heads"] and done["after"]["hidden"] == done["before"]["hidden"]:
        return details
    after = {**result["after"], **{key: done["after"][key] for key in ("heads", "kv_heads", "hidden", "params")}}
    details["transformer"] = {**result, "after": after, "in_place": done}
    details["notes"] = [note for note in details.get("notes", []) if "every head kept" not in note]
    details["notes"].append(
        f"structured_prune then cut the heads in place, {done['before']['heads']}->{after['heads']} with the hidden "
        f"size {done['before']['hidden']}->{after['hidden']}: the stock class takes fewer heads only with a "
        "narrower stream")
    return details


def describes_transformer(model: nn.Module) -> bool:
    """Whether :func:`prune_transformer` can take ``model``: a Hugging Face model
    (:func:`optkit.kinds.is_hf_pretrained`) whose config has an int hidden size and head count, with a
    ``ModuleList`` of repeated blocks."""
    from optkit.kinds import is_hf_pretrained

    if not is_hf_pretrained(model):
        return False
    config = model.config
    if config_int(config, HIDDEN_FIELDS) is None or config_int(config, HEAD_FIELDS) is None:
        return False
    return bool(find_block_lists(model))


def _find(model: nn.Module, inputs: dict, hidden: int, heads: int, skipped: list[str]) -> list[Block]:
    config = model.config
    kv = config_int(config, KV_FIELDS) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    blocks = [Block(block, f"{name}.{i}") for name, blocks in find_block_lists(model) for i, block in enumerate(blocks)]
    if not blocks:
        raise OptkitError("no ModuleList of repeated blocks found in the model; only block-stacked transformers can be pruned")
    calls = trace(model, inputs, blocks)
    for block in blocks:
        parse_block(block, calls[id(block.module)], hidden, heads, kv, head_dim)
        skipped += block.skipped
    return blocks


def _stream(blocks: list[Block], hidden: int) -> list[torch.Tensor]:
    """The residual stream entering each block: its first float input as wide as the hidden size."""
    samples = []
    for block in blocks:
        args, kwargs = block.call or ((), {})
        found = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.is_floating_point()
                 and x.dim() >= 2 and x.shape[-1] == hidden]
        samples += found[:1]
    return samples


def _prune_heads(model: nn.Module, blocks: list[Block], ratio: float, activations: Activations,
                 skipped: list[str], stream: list[torch.Tensor], with_hidden: bool, commit: Commit,
                 inputs: dict[str, Any]) -> None:
    owners = [(b, a) for b in blocks for a in (*b.attentions, *b.bound)]
    attentions = [a for _, a in owners]
    if not attentions:
        return
    fixed = next((a for a in attentions if a.fixed), None)
    if fixed is not None:
        skipped.append(f"heads: {fixed.o.name}'s heads keep their positions (only the dims inside each head "
                       "permute freely: a per-head bias follows from the head's position, as ALiBi's slopes do); "
                       "no head removed")
        return
    shared = any(a.shared for a in attentions)
    heads, kv = attentions[0].heads, attentions[0].kv_heads
    groups = heads // kv
    whole_groups = kv > 1 and round(kv * ratio) >= 1
    drop = round(kv * ratio) if whole_groups else round(groups * ratio) if kv == 1 or groups > 1 else 0
    keep = (kv if whole_groups else groups) - drop
    if drop < 1 or keep < 1:
        skipped.append(f"heads: a ratio of {ratio} removes no whole {'KV group' if whole_groups else 'head'} "
                       f"of {kv if whole_groups else groups}; no head pruned")
        return
    new_kv, new_heads = (keep, keep * groups) if whole_groups else (kv, kv * keep)
    hidden, head_dim = config_int(model.config, HIDDEN_FIELDS), attentions[0].head_dim
    before = _shared_inputs(model, inputs, blocks) if shared else {}
    chosen: list[tuple[list[int], list[list[int]]]] = []

    def choose(scores: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[int], list[list[int]]]:
        group_score, q_score = scores
        if whole_groups:
            return sorted(group_score.topk(keep).indices.tolist()), [list(range(groups))] * keep
        return list(range(kv)), [sorted(q_score[i].topk(keep).indices.tolist()) for i in range(kv)]

    def cut(new_hidden: int | None = None, every_equal_field: bool = False) -> None:
        scores = [head_scores(attention, activations) for attention in attentions]
        if shared:  # the same heads go from every block: scores summed over the blocks
            summed = choose((sum(s[0] for s in scores), sum(s[1] for s in scores)))
            chosen[:] = [summed] * len(attentions)
        else:
            chosen[:] = [choose(score) for score in scores]
        for attention, (kept_kv, kept_q) in zip(attentions, chosen, strict=True):
            attention.select(kept_kv, kept_q)
        config = model.config
        set_by_value(config, HEAD_FIELDS, heads, new_heads)
        set_by_value(config, KV_FIELDS, kv, new_kv)
        _cut_head_axes(model, blocks, [_q_heads(kept, groups) for kept in chosen], heads, new_heads,
                       {} if new_hidden is None else {hidden_size.hidden_field(config): new_hidden})
        if new_hidden is not None:
            hidden_size.shrink(model, hidden, new_hidden, _widths(blocks), stream, WIDTH_FIELDS,
                               every_equal_field=every_equal_field)
        if (getattr(config, "head_dim", None) or config_int(config, HIDDEN_FIELDS) // new_heads) != head_dim:
            try:
                config.head_dim = head_dim
            except AttributeError as error:  # a property of the class, derived from the hidden size
                raise hidden_size.Refused(f"the config derives head_dim ({error})") from None

    def kept_inputs() -> str | None:
        """Whether every block is given the kept heads' part of each per-head input it was given before."""
        if not shared:
            return None
        after = _shared_inputs(model, inputs, blocks)
        for (block, attention), kept in zip(owners, chosen, strict=True):
            for key, axis in attention.shared:
                old, new = before.get((block.path, key)), after.get((block.path, key))
                expected = None if old is None else old.index_select(axis, _q_heads(kept, groups))
                if new is None or expected is None or new.shape != expected.shape or not torch.allclose(
                        new, expected, atol=1e-5, rtol=1e-4):
                    return (f"{block.path} is given {key!r} per head, and the stock class computes it anew for "
                            f"{new_heads} heads instead of keeping the kept heads' (as ALiBi's slopes follow the "
                            "head count)")
        return None

    what = f"heads {heads}->{new_heads} (kv {kv}->{new_kv})"
    if shared:
        what += ", the same in every block"
    undo = _snapshot(blocks)
    refusals: list[str] = []
    if commit(model, cut, what, refusals, undo, verify=kept_inputs):
        return
    if with_hidden and hidden == heads * head_dim:
        # The stock class may derive the head width from hidden / heads: fewer heads then need a narrower stream.
        new_hidden = new_heads * head_dim
        with_stream = f"{what} with hidden size {hidden}->{new_hidden}"
        if commit(model, lambda: cut(new_hidden), with_stream, refusals, undo, verify=kept_inputs):
            return
        # A layer sized by a field of its own that equals the hidden size (DeBERTa's pooler_hidden_size) matches
        # the stock shapes but not the narrowed stream: every such field follows the stream.
        if "does not run" in refusals[-1] and commit(
                model, lambda: cut(new_hidden, every_equal_field=True),
                f"{with_stream} and every field equal to it", refusals, undo, verify=kept_inputs):
            return
    skipped += refusals


def _q_heads(kept: tuple[list[int], list[list[int]]], groups: int) -> torch.Tensor:
    """The query heads kept, in order, as one index."""
    kept_kv, kept_q = kept
    return torch.tensor([kv * groups + j for kv, js in zip(kept_kv, kept_q, strict=True) for j in js])


def _cut_head_axes(model: nn.Module, blocks: list[Block], kept: list[torch.Tensor], heads: int, new_heads: int,
                   fields: dict[str, Any]) -> None:
    """Cut the tensors outside the blocks that have a head axis in the stock class (``model.config`` with
    ``fields`` on top): an axis of ``heads`` (a relative-position bias table shared by every block, when every
    block keeps the same heads) keeps ``kept[0]``; one of ``blocks x heads`` (a head reading every block's
    attention maps, stacked block by block) keeps each block's kept heads. Other differences are left to the
    hidden-size cut and the stock-class check."""
    inside = tuple(f"{block.path}." for block in blocks)
    stock = hidden_size.stock_shapes(model, fields)
    if stock is None:
        return
    same = all(torch.equal(k, kept[0]) for k in kept)
    stacked = torch.cat([i * heads + k for i, k in enumerate(kept)]) if len(kept) == len(blocks) else None
    tensors = hidden_size.named_tensors(model)
    replaced: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        theirs = stock.get(name)
        if name.startswith(inside) or theirs is None or tuple(tensor.shape) == theirs or len(theirs) != tensor.dim():
            continue
        if id(tensor) not in replaced:
            data = tensor.detach()
            for axis, (mine, new) in enumerate(zip(tensor.shape, theirs, strict=True)):
                if (mine, new) == (heads, new_heads) and same:
                    data = data.index_select(axis, kept[0].to(data.device))
                elif stacked is not None and (mine, new) == (len(blocks) * heads, len(blocks) * new_heads):
                    data = data.index_select(axis, stacked.to(data.device))
            if data.shape == tensor.shape:
                continue
            replaced[id(tensor)] = nn.Parameter(data.clone(), requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else data.clone()
        hidden_size.set_tensor(model, name, replaced[id(tensor)])


def _shared_inputs(model: nn.Module, inputs: dict[str, Any], blocks: list[Block]) -> dict[tuple[str, Any], Any]:
    """Per block and per-head input (see :attr:`.structure.Attention.shared`), what the block is given now."""
    wanted = {id(b.module): (b, [key for a in (*b.attentions, *b.bound) for key, _ in a.shared]) for b in blocks}
    found: dict[tuple[str, Any], Any] = {}

    def hook(module, args, kwargs):
        block, keys = wanted[id(module)]
        for key in keys:
            value = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key)
            found.setdefault((block.path, key), value.detach().clone() if isinstance(value, torch.Tensor) else None)

    handles = [b.module.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks if wanted[id(b.module)][1]]
    run_hooked(model, inputs, handles)
    return found


def _prune_hidden(model: nn.Module, blocks: list[Block], hidden: int, new_hidden: int, stream: list[torch.Tensor],
                  skipped: list[str], commit: Commit) -> None:
    current = config_int(model.config, HIDDEN_FIELDS)
    if current != hidden:
        skipped.append(f"hidden size: followed the heads ({hidden}->{current}), as this class's head width is "
                       "hidden / heads; hidden_ratio was not applied on top")
        return
    commit(model, lambda: hidden_size.shrink(model, hidden, new_hidden, _widths(blocks), stream, WIDTH_FIELDS),
            f"hidden size {hidden}->{new_hidden}", skipped, _snapshot(blocks))


def _hidden_to_reach(model: nn.Module, blocks: list[Block], hidden: int, target: int, ratio: float, round_to: int,
                     stream: list[torch.Tensor], activations: Activations, skipped: list[str], commit: Commit) -> None:
    """Narrow the residual stream until the parameters reach ``target`` (the heads or MLP the stock class fixed
    could not get there): the widest multiple of ``round_to`` that does, at most ``ratio`` of the stream gone.

    The widths the stock class derives from the hidden size follow it: an MLP of 4x the hidden size keeps its
    strongest channels, heads of ``hidden / heads`` dims their strongest dims (where dims permute freely inside
    a head, so not with rotary embeddings); :func:`.hidden.shrink` then cuts every hidden-sized axis.
    """
    field = hidden_size.hidden_field(model.config)
    floor = kept_width(hidden, ratio, round_to)
    sizes: dict[int, int] = {}
    for width in sorted(set(range(floor, hidden, max(round_to, 1))) | {floor}, reverse=True):
        try:
            sizes[width] = _params(hidden_size.stock_model(model, {field: width}))
        except Exception:  # noqa: BLE001 - a width the class refuses is no candidate
            continue
    if not sizes:
        skipped.append(f"hidden size: the stock class builds no narrower stream than {hidden} (down to {floor})")
        return
    new_hidden = next((w for w, size in sizes.items() if size <= target), min(sizes))
    current = _params(model)

    def cut() -> None:
        _narrow_interiors(model, blocks, {field: new_hidden}, activations)
        hidden_size.shrink(model, hidden, new_hidden, _widths(blocks), stream, WIDTH_FIELDS)

    what = f"hidden size {hidden}->{new_hidden}"
    if commit(model, cut, what, skipped, _snapshot(blocks)):
        skipped.append(f"{what} instead, with the widths the stock class derives from it: fewer heads or MLP "
                       f"channels were refused, and {current} parameters were above the {target} the ratios "
                       f"aim at (now {_params(model)})")


def _narrow_interiors(model: nn.Module, blocks: list[Block], fields: dict[str, Any], activations: Activations) -> None:
    """Cut the MLP widths and head dims that the stock class built with ``fields`` derives anew, keeping the
    strongest channels and dims; the query and key dims are rescaled where the class's score scaling changes.

    Raises:
        hidden.Refused: for a width the class changes that cannot be cut so (dims that do not permute freely).
    """
    fresh = hidden_size.stock_model(model, fields)
    shapes = {n: tuple(p.shape) for n, p in fresh.named_parameters(remove_duplicate=False)}
    for block in blocks:
        for mlp in block.mlps:
            stock = shapes.get(f"{mlp.down.name}.weight")
            width = stock[1 - mlp.down.out_axis] if stock else mlp.width
            if width < mlp.width:
                mlp.select(channel_scores(mlp, activations).topk(width).indices.sort().values)
        for attention in (*block.attentions, *block.bound):
            stock = shapes.get(f"{attention.o.name}.weight")
            inner = stock[1 - attention.o.out_axis] if stock else attention.heads * attention.head_dim
            if inner >= attention.heads * attention.head_dim:
                continue
            if inner % attention.heads or not (attention.fixed or dims_permute_freely(block, attention)):
                raise hidden_size.Refused(f"{attention.o.name}: the stock class narrows its heads to {inner} dims "
                                          "in all, which only dims that permute freely inside each head allow")
            dims = inner // attention.heads
            qk, vo = dim_scores(attention, activations)
            kept = ([s.topk(dims).indices.sort().values for s in qk], [s.topk(dims).indices.sort().values for s in vo])
            attention.select(*attention.every(), dims=kept)
            _rescale_scores(model, fresh, attention)


def _rescale_scores(model: nn.Module, fresh: nn.Module, attention: Any) -> None:
    """Where the stock class scales scores by a float setting of the attention module that differs for the
    narrower heads (``1/sqrt(head_dim)``), scale the query and key rows by its inverse square root each, so the
    kept dims' scores stay as they were."""
    names = {id(m): n for n, m in model.named_modules()}
    paths = [names[id(layer.module)].split(".") for layer in attention.layers()]
    common = [parts[0] for parts in zip(*paths) if len(set(parts)) == 1]
    for end in range(len(common), 0, -1):  # the innermost module holding a setting that changed
        path = ".".join(common[:end])
        mine, theirs = vars(model.get_submodule(path)), vars(fresh.get_submodule(path))
        changed = [theirs[k] / v for k, v in mine.items() if type(v) is float and type(theirs.get(k)) is float
                   and v and theirs[k] != v]
        if len(changed) == 1:
            factor = changed[0]
            break
    else:
        return
    nothing = torch.zeros(0, dtype=torch.long)
    every = torch.arange(attention.head_dim)
    rows = attention.rows_for(*attention.every(), ([every] * attention.kv_heads, [nothing] * attention.kv_heads))
    with torch.no_grad():
        for layer in attention.qkv:
            weight = layer.module.weight
            index = rows[id(layer)].to(weight.device)
            if layer.out_axis == 0:
                weight[index] *= factor ** -0.5
            else:
                weight[:, index] *= factor ** -0.5
            bias = getattr(layer.module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias[index] *= factor ** -0.5


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _unit_params(blocks: list[Block], kind: str) -> int:
    """Parameters of the blocks' attention (``attention``) or MLP and expert (``mlp``) layers."""
    if kind == "attention":
        modules = {id(layer.module): layer.module for b in blocks for a in (*b.attentions, *b.bound)
                   for layer in a.layers()}
        return sum(p.numel() for m in modules.values() for p in m.parameters())
    modules = {id(layer.module): layer.module for b in blocks for m in b.mlps for layer in m.layers()}
    count = sum(p.numel() for m in modules.values() for p in m.parameters())
    return count + sum(getattr(e.module, n).numel() for b in blocks for e in b.experts for n in (*e.ups, e.down))


def _unit_shape(blocks: list[Block]) -> tuple[list[int], list[int]]:
    """The head counts and MLP widths of the blocks' units."""
    return [a.heads for b in blocks for a in (*b.attentions, *b.bound)], _widths(blocks)


def _refused(blocks: list[Block], shape: tuple[list[int], list[int]], heads_ratio: float, mlp_ratio: float) -> bool:
    """Whether the heads or the MLP, asked to shrink, kept their ``shape`` (refused, or no such unit found)."""
    heads, widths = _unit_shape(blocks)
    return (heads_ratio > 0 and (not heads or heads == shape[0])) or (mlp_ratio > 0 and (not widths or widths == shape[1]))


def _widths(blocks: list[Block]) -> list[int]:
    return sorted({u.width for b in blocks for u in (*b.mlps, *b.experts)})


def _snapshot(blocks: list[Block]) -> Callable[[], None]:
    """A function that puts the units' recorded head counts and layer widths back (after a refused change)."""
    objects = [o for b in blocks for a in (*b.attentions, *b.bound) for o in (a, *a.layers())]
    objects += [o for b in blocks for m in b.mlps for o in (m, *m.layers())]
    saved = [(o, dict(vars(o))) for o in objects]

    def undo() -> None:
        for obj, state in saved:
            vars(obj).update(state)
    return undo


def _prune_mlps(model: nn.Module, blocks: list[Block], ratio: float, round_to: int, activations: Activations,
                skipped: list[str], commit: Commit) -> None:
    units = [u for b in blocks for u in (*b.mlps, *b.experts)]
    widths = sorted({u.width for u in units})
    if not units:
        return
    new = {w: kept_width(w, ratio, round_to) for w in widths}

    def cut() -> None:
        for unit in units:
            keep = new[unit.width]
            if isinstance(unit, Mlp):
                unit.select(channel_scores(unit, activations).topk(keep).indices.sort().values)
            else:
                unit.select(expert_scores(unit).topk(keep, dim=1).indices.sort(dim=1).values)
        for old, kept in new.items():
            set_width(model.config, old, kept)

    def what() -> str:
        return "MLP widths " + ", ".join(f"{w}->{k}" for w, k in new.items())

    undo, refusals = _snapshot(blocks), []
    if commit(model, cut, what(), refusals, undo):
        return
    # A config may state the width as a whole multiple of the hidden size (an int mlp_ratio): keep the nearest.
    hidden = config_int(model.config, HIDDEN_FIELDS)
    whole = {w: min(max(hidden, round(k / hidden) * hidden), w - hidden) for w, k in new.items()} if hidden else {}
    if whole and whole != new and all(hidden <= k < w for w, k in whole.items()):
        new.update(whole)
        if commit(model, cut, f"{what()} (whole multiples of the hidden size)", refusals, undo):
            return
    skipped += refusals


def kept_width(width: int, ratio: float, round_to: int) -> int:
    """The width kept when ``ratio`` of ``width`` goes, rounded to ``round_to`` (never all, never none)."""
    exact = width * (1 - ratio)
    rounded = max(round_to, round(exact / round_to) * round_to)
    if rounded < width:
        return rounded
    return max(1, min(width - 1, math.floor(exact)))


def set_width(config: Any, old: int, new: int) -> None:
    """Set the config's MLP width ``old`` to ``new``: the width field holding it (or an unset one), else a float
    field that gives it as a multiple of the hidden size (an ``mlp_ratio``), which is set to ``new / hidden``."""
    present = [getattr(config, name) for name in WIDTH_FIELDS if hasattr(config, name)]
    hidden = config_int(config, HIDDEN_FIELDS)
    if old in present or None in present or not hidden:
        set_by_value(config, WIDTH_FIELDS, old, new, fill_none=True)
        return
    counts = set(HEAD_FIELDS) | set(KV_FIELDS) | set(LAYER_FIELDS) | set(HIDDEN_FIELDS)
    multiples = [key for key, value in config.to_dict().items()
                 if type(value) in (int, float) and key not in counts and abs(value * hidden - old) < 1e-6]
    if multiples:
        ratio = new / hidden
        while int(hidden * ratio) < new:  # the stock class takes int(hidden * ratio)
            ratio = math.nextafter(ratio, math.inf)
        floats = [key for key in multiples if type(getattr(config, key)) is float]
        if floats:
            setattr(config, floats[0], ratio)
        elif new % hidden == 0:  # an int field (a typed config refuses a float there)
            setattr(config, multiples[0], new // hidden)


def set_by_value(config: Any, names: tuple[str, ...], old: int, new: int, fill_none: bool = False) -> None:
    """Set every field of ``names`` that holds ``old`` to ``new`` (or, with ``fill_none``, the first unset one)."""
    present = [n for n in names if hasattr(config, n)]
    matched = [n for n in present if getattr(config, n) == old]
    if not matched and fill_none:
        matched = [n for n in present if getattr(config, n) is None][:1]
    for name in matched:
        setattr(config, name, new)


def _commit(model: nn.Module, change: Callable[[], None], what: str, skipped: list[str],
            undo: Callable[[], None] | None = None, *, inputs: dict[str, Any],
            verify: Callable[[], str | None] | None = None) -> bool:
    """Run ``change`` (cuts weights, edits the config); keep it if the stock class built from the config agrees,
    the model still runs on ``inputs`` and ``verify`` (if given) finds nothing wrong after that.

    Otherwise the parameters, buffers, module settings, block lists and config are put back, ``undo`` runs,
    and one line saying why goes to ``skipped``.
    """
    saved_params = [(m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False)]
    saved_buffers = [(m, dict(m._buffers)) for m in model.modules()]
    saved_settings = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_") and is_setting(v)})
                      for m in model.modules()]
    saved_config = copy.deepcopy(vars(model.config))
    saved_lists = {id(m): (m, list(m)) for m in model.modules() if isinstance(m, nn.ModuleList)}
    try:
        change()
        problem = matches_stock(model) or _fails_to_run(model, inputs) or (verify() if verify else None)
    except hidden_size.Refused as refusal:
        problem = str(refusal)
    except Exception as error:  # noqa: BLE001 - a config that refuses a value (typed fields) refuses the change
        problem = f"{type(error).__name__}: {first_line(error)}"
    if problem is None:
        return True
    for owner, name, param in saved_params:
        setattr(owner, name, param)
    for owner, settings in saved_settings:
        vars(owner).update(settings)
    for owner, buffers in saved_buffers:
        owner._buffers.update(buffers)
    for module_list, items in saved_lists.values():
        module_list._modules.clear()
        module_list.extend(items)
    vars(model.config).clear()
    vars(model.config).update(saved_config)
    if undo is not None:
        undo()
    skipped.append(f"{what}: not done, the stock class cannot describe it ({problem})")
    return False


def _fails_to_run(model: nn.Module, inputs: dict[str, Any]) -> str | None:
    """``None`` when ``model(**inputs)`` runs; else why not, in one line (a layer the config sizes apart, such as
    a pooler with a width field of its own, still expecting the old width)."""
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as error:  # noqa: BLE001 - any failure refuses the change
        return f"the pruned model does not run: {type(error).__name__}: {first_line(error)}"
    return None


def matches_stock(model: nn.Module) -> str | None:
    """None when the class built from ``model.config`` has the same parameters; copies its scalar attributes."""
    from optkit.io.hf import stock_class

    try:
        # What from_pretrained does with the written config.json; newer transformers validate it there
        # (hidden size a multiple of the head count, even with an explicit head_dim), setattr does not.
        type(model.config).from_dict(model.config.to_dict())
    except Exception as error:  # noqa: BLE001 - any refusal of the config is the answer
        return f"its config.json would not load: {type(error).__name__}: {first_line(error, lines=2)}"
    try:
        with torch.device("meta"):
            fresh = stock_class(model)(model.config)
    except Exception as error:  # noqa: BLE001 - any refusal of the config is the answer
        return f"{type(error).__name__}: {first_line(error, lines=2)}"
    ours = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    theirs = {n: tuple(p.shape) for n, p in fresh.named_parameters(remove_duplicate=False)}
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            return f"{name}: pruned {ours.get(name)}, stock {theirs.get(name)}"
    fresh_modules = dict(fresh.named_modules())
    for name, module in model.named_modules():
        other = fresh_modules.get(name)
        if other is None:
            continue
        for key, value in vars(module).items():
            theirs_value = vars(other).get(key)
            if (not key.startswith("_") and key != "training" and is_setting(value)
                    and type(theirs_value) is type(value) and theirs_value != value):
                setattr(module, key, theirs_value)
    hidden_size.refresh_derived_buffers(model)
    return None


def is_setting(value: Any) -> bool:
    """A scalar or a tuple of scalars (a norm's ``normalized_shape``): a size or setting the class derives."""
    items = value if isinstance(value, tuple) else (value,)
    return all(isinstance(v, int | float | str) for v in items)


def _default_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    import inspect

    config = model.config
    generator = torch.Generator().manual_seed(0)
    vocab = getattr(config, "vocab_size", None)
    takes = inspect.signature(model.forward).parameters
    if isinstance(vocab, int) and ("input_ids" in takes or "pixel_values" not in takes):
        return {"input_ids": torch.randint(0, vocab, (2, 16), generator=generator)}
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", 3)
    if isinstance(size, int):
        return {"pixel_values": torch.randn(1, channels, size, size, generator=generator)}
    raise OptkitError("no example inputs given and the config has neither vocab_size nor image_size; "
                      "pass example_inputs={...} for model(**example_inputs)")


def _summary(model: nn.Module, blocks: list[Block]) -> dict[str, Any]:
    config = model.config
    attentions = [a for b in blocks for a in (*b.attentions, *b.bound)]
    widths = sorted({u.width for b in blocks for u in (*b.mlps, *b.experts)})
    heads = config_int(config, HEAD_FIELDS)
    return {
        "heads": heads,
        "kv_heads": config_int(config, KV_FIELDS) or heads,
        "intermediate": widths or [w for n in WIDTH_FIELDS if isinstance(w := getattr(config, n, None), int)],
        "hidden": config_int(config, HIDDEN_FIELDS),
        "layers": config_int(config, LAYER_FIELDS),
        "params": sum(p.numel() for p in model.parameters()),
        "attention_units": len(attentions),
    }
