"""Hidden-size pruning: remove channels of the residual stream from every tensor the config sizes by it.

Which axes carry the hidden size is read from the stock class, not from names: built from the config with a
new hidden size (on the meta device, nothing allocated), its parameters and buffers differ from the model's
exactly on those axes (the hidden size here, the new one there). That finds the token, position and token-type
embeddings, every norm on the stream, every projection reading or writing it, the output embeddings (one tensor
when tied, so they stay tied) and classifier or pooler heads. Every such axis keeps the same channels, so a space
the hidden size sizes (the stream, a pooler's output) is cut alike wherever it is written and read.

Config fields the stock class derives from the hidden size when they are unset (an MLP width left ``None``) are
pinned to the model's widths first; other fields equal to the hidden size (an embedding projection width) follow
it only when the stock class needs them to.

Channels are kept by a measured score: each stream-sized weight's share of energy in the channel (one vote per
tensor axis) plus the channel's share of the stream's energy at the blocks' inputs on the example inputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optkit.passes.prune.hf.structure import HEAD_FIELDS, HIDDEN_FIELDS, KV_FIELDS, LAYER_FIELDS


class Refused(Exception):
    """The stock class cannot describe the change; the message says why (one line)."""


@dataclass
class Cut:
    """Tensor ``name`` (a parameter or buffer of the model) loses channels on ``axes``."""

    name: str
    axes: tuple[int, ...]


def shrink(model: nn.Module, hidden: int, new_hidden: int, widths: list[int], stream: list[torch.Tensor],
           width_fields: tuple[str, ...], *, every_equal_field: bool = False) -> list[int]:
    """Cut the residual stream of ``model`` from ``hidden`` to ``new_hidden`` channels and update its config.

    Args:
        model: a Hugging Face model; changed in place (parameters, buffers, config).
        hidden: the current hidden size.
        new_hidden: channels to keep.
        widths: the MLP widths found in the blocks (pinned into unset config width fields).
        stream: samples of the residual stream (block inputs, last dim ``hidden``) for the activation score.
        width_fields: the config's MLP width fields (kept as they are; an unset one may be pinned to ``widths``).
        every_equal_field: set every other int field equal to ``hidden`` to ``new_hidden`` from the start (a
            layer sized by a field of its own that reads the stream); by default such a field is set only when
            it brings the stock shapes closer to the model's.

    Returns:
        the kept channel indices, ascending.

    Raises:
        Refused: when no config with the new hidden size builds a stock model whose tensors differ from the
            model's only on hidden-sized axes.
    """
    fields, cuts = _plan(model, hidden, new_hidden, widths, width_fields, every_equal_field)
    tensors = named_tensors(model)
    kept = torch.sort(_scores(tensors, cuts, stream, hidden).topk(new_hidden).indices).values
    _apply(model, tensors, cuts, kept)
    for name, value in fields.items():
        setattr(model.config, name, value)
    return kept.tolist()


def _plan(model: nn.Module, hidden: int, new_hidden: int, widths: list[int], width_fields: tuple[str, ...],
          every_equal_field: bool = False) -> tuple[dict[str, Any], list[Cut]]:
    """The config fields to set and the tensor axes to cut; further fields are added one at a time while they help."""
    config = model.config
    fields: dict[str, Any] = {hidden_field(config): new_hidden}
    skip = set(width_fields) | set(HEAD_FIELDS) | set(KV_FIELDS) | set(LAYER_FIELDS) | set(HIDDEN_FIELDS)
    # An unset MLP width the stock class derives from the hidden size keeps the model's width.
    options = [(name, widths[0]) for name in width_fields
               if len(widths) == 1 and hasattr(config, name) and getattr(config, name) is None]
    equal = [(key, new_hidden) for key, value in config.to_dict().items()
             if key not in skip and type(value) is int and value == hidden]
    if every_equal_field:
        fields.update(equal)
    else:
        options += equal
    cuts, problems = _compare(model, fields, hidden, new_hidden)
    while problems and options:
        tried = [(option, *_compare(model, {**fields, option[0]: option[1]}, hidden, new_hidden))
                 for option in options]
        option, best_cuts, best_problems = min(tried, key=lambda item: len(item[2]))
        if len(best_problems) >= len(problems):
            break
        fields[option[0]] = option[1]
        options.remove(option)
        cuts, problems = best_cuts, best_problems
    if problems:
        raise Refused(f"hidden size {hidden}->{new_hidden}: {problems[0]}"
                      + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return fields, cuts


def hidden_field(config: Any) -> str:
    """The config field that holds the hidden size."""
    return next(name for name in HIDDEN_FIELDS if isinstance(getattr(config, name, None), int))


def stock_model(model: nn.Module, fields: dict[str, Any]) -> nn.Module:
    """The model's stock class built on the meta device from its config with ``fields`` set (raises what the
    class raises for a config it refuses)."""
    from optkit.io.hf import stock_class

    config = copy.deepcopy(model.config)
    for name, value in fields.items():
        setattr(config, name, value)
    with torch.device("meta"):
        return stock_class(model)(config)


def stock_shapes(model: nn.Module, fields: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """Every parameter's and buffer's shape in :func:`stock_model`, by every name; ``None`` if the class
    refuses the config."""
    try:
        fresh = stock_model(model, fields)
    except Exception:  # noqa: BLE001 - any refusal of the config is the answer
        return None
    return {n: tuple(t.shape) for n, t in named_tensors(fresh).items()}


def _compare(model: nn.Module, fields: dict[str, Any], hidden: int, new_hidden: int) -> tuple[list[Cut], list[str]]:
    """Axes to cut so every tensor has the stock class's shape, and what no cut explains."""
    try:
        fresh = stock_model(model, fields)
    except Exception as error:  # noqa: BLE001 - any refusal of the config is the answer
        return [], [f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"]
    ours = {n: tuple(t.shape) for n, t in named_tensors(model).items()}
    theirs = {n: tuple(t.shape) for n, t in named_tensors(fresh).items()}
    cuts, problems = [], []
    for name in sorted(set(ours) | set(theirs)):
        mine, stock = ours.get(name), theirs.get(name)
        if mine is None or stock is None:
            problems.append(f"{name}: {'only the stock class has it' if mine is None else 'the stock class lacks it'}")
            continue
        axes = tuple(i for i, (a, b) in enumerate(zip(mine, stock, strict=False)) if a != b)
        if len(mine) != len(stock) or any((mine[i], stock[i]) != (hidden, new_hidden) for i in axes):
            problems.append(f"{name}: pruned {mine}, stock {stock}")
        elif axes:
            cuts.append(Cut(name, axes))
    return cuts, problems


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by every name they have (a tied tensor appears under each owner)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def _scores(tensors: dict[str, torch.Tensor], cuts: list[Cut], stream: list[torch.Tensor],
            hidden: int) -> torch.Tensor:
    """Per channel: mean share of energy over the cut tensor axes, plus its share of the stream's energy."""
    weights = torch.zeros(hidden)
    votes = 0
    seen: set[tuple[int, int]] = set()
    for cut in cuts:
        tensor = tensors[cut.name].detach().float()
        for axis in cut.axes:
            if (id(tensors[cut.name]), axis) in seen:
                continue
            seen.add((id(tensors[cut.name]), axis))
            energy = tensor.pow(2).sum([d for d in range(tensor.dim()) if d != axis]) if tensor.dim() > 1 \
                else tensor.pow(2)
            if energy.sum() > 0:
                weights += (energy / energy.sum()).cpu()
                votes += 1
    score = weights / max(votes, 1)
    energies = [x.detach().float().pow(2).reshape(-1, hidden).mean(0).cpu() for x in stream]
    energies = [e / e.sum() for e in energies if e.sum() > 0]
    if energies:
        score = score + torch.stack(energies).mean(0)
    return score


def _apply(model: nn.Module, tensors: dict[str, torch.Tensor], cuts: list[Cut], kept: torch.Tensor) -> None:
    """Replace each cut tensor by its kept channels, once per tensor, set on every name it has."""
    replaced: dict[int, torch.Tensor] = {}
    for cut in cuts:
        old = tensors[cut.name]
        if id(old) not in replaced:
            data = old.detach()
            for axis in cut.axes:
                data = data.index_select(axis, kept.to(data.device))
            data = data.clone()
            replaced[id(old)] = nn.Parameter(data, requires_grad=old.requires_grad) \
                if isinstance(old, nn.Parameter) else data
        set_tensor(model, cut.name, replaced[id(old)])


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` where parameter or buffer ``name`` of ``model`` is."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(tensor, nn.Parameter):
        setattr(owner, attr, tensor)
    else:
        owner._buffers[attr] = tensor


def refresh_derived_buffers(model: nn.Module) -> None:
    """Recompute the buffers the class derives from its config and never saves (an embedding scale of
    sqrt(hidden), rotary frequencies), as the stock class computes them when it loads the saved folder.

    Each owner is copied with its parameters on the meta device (nothing allocated) and re-initialized by the
    model's own ``_init_weights``; only those buffers are taken from the copy.
    """
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return
    for module in model.modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                for p in module.parameters()}
        fresh = copy.deepcopy(module, memo)
        try:
            init(fresh)
        except Exception:  # noqa: BLE001 - a module its class cannot re-initialize keeps its buffers
            continue
        for name in names:
            ours, theirs = module._buffers[name], fresh._buffers.get(name)
            if (theirs is not None and theirs.device.type != "meta" and theirs.shape == ours.shape
                    and not torch.equal(theirs.to(ours), ours)):
                module._buffers[name] = theirs.to(ours)
