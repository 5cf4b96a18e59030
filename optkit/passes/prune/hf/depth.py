"""Depth pruning: remove the blocks that change their input least (ShortGPT's criterion).

A block's score is the mean cosine similarity between its input and output
hidden states on the example inputs; the most similar blocks go. The config's
layer count and its per-layer lists (layer types, sliding windows: any list as
long as the block list) are shortened, lists of layer indices renumbered, and
the blocks' ``layer_idx``-like attributes come from the stock class built from
the new config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from optkit.core.errors import OptkitError
from optkit.passes.prune.hf.structure import LAYER_FIELDS, config_int, find_block_lists


def block_similarity(model: nn.Module, blocks: nn.ModuleList, inputs: dict[str, Any]) -> list[float]:
    """Mean cosine similarity of each block's input and output hidden states."""
    scores: dict[int, float] = {}
    handles = []
    for index, block in enumerate(blocks):
        def hook(module, args, kwargs, output, index=index):
            x = args[0] if args else kwargs.get("hidden_states")
            y = output[0] if isinstance(output, tuple) else output
            scores[index] = nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).mean().item()
        handles.append(block.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in range(len(blocks)) if i not in scores]
    if missing:
        raise OptkitError(f"blocks {missing} were not called by the example inputs; pass inputs that run every block")
    return [scores[i] for i in range(len(blocks))]


def drop(model: nn.Module, count: int, inputs: dict[str, Any], commit: Callable) -> list[int]:
    """Remove ``count`` blocks (most similar input/output first); returns their original indices."""
    lists = find_block_lists(model)
    if len(lists) != 1:
        raise OptkitError(f"depth pruning needs one list of blocks, found {len(lists)} "
                          f"({', '.join(n for n, _ in lists)}); use drop_blocks=0 for this model")
    _, blocks = lists[0]
    total = len(blocks)
    if not 0 < count < total:
        raise OptkitError(f"drop_blocks must be between 1 and {total - 1} for this {total}-block model, got {count}")
    similarity = block_similarity(model, blocks, inputs)
    dropped = sorted(sorted(range(total), key=lambda i: -similarity[i])[:count])
    kept = [i for i in range(total) if i not in dropped]

    def cut() -> None:
        items = list(blocks)
        blocks._modules.clear()
        blocks.extend(items[i] for i in kept)
        _shorten_config(model.config, total, kept)

    skipped: list[str] = []
    if not commit(model, cut, f"drop blocks {dropped}", skipped):
        raise OptkitError(skipped[0])
    return dropped


def _shorten_config(config: Any, total: int, kept: list[int]) -> None:
    for name in LAYER_FIELDS:
        if config_int(config, (name,)) == total:
            setattr(config, name, len(kept))
    renumber = {old: new for new, old in enumerate(kept)}
    for key, value in config.to_dict().items():
        if not isinstance(value, list) or key in LAYER_FIELDS:
            continue
        if len(value) == total:
            setattr(config, key, [value[i] for i in kept])
        elif key.endswith("layers") and all(isinstance(v, int) and 0 <= v < total for v in value):
            setattr(config, key, [renumber[v] for v in value if v in renumber])
