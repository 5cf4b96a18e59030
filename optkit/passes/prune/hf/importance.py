"""Importance of heads, KV groups and MLP channels: L2 norm of the weights that belong to each.

``activations`` (optional) maps a layer's name to the norm of each of its input
channels over calibration data; a weight then counts as ``|W| * ||x||``
(Wanda-style), so activation-aware scores use the same interface.
"""

from __future__ import annotations

import torch

from optkit.passes.prune.hf.structure import Attention, Experts, Layer, Mlp

Activations = dict[str, torch.Tensor] | None


def _scaled(layer: Layer, activations: Activations) -> torch.Tensor:
    rows = layer.rows().float()
    if activations and layer.name in activations:
        rows = rows * activations[layer.name].to(rows)
    return rows


def _row_sq(layer: Layer, activations: Activations) -> torch.Tensor:
    return _scaled(layer, activations).pow(2).sum(1)


def _col_sq(layer: Layer, activations: Activations) -> torch.Tensor:
    return _scaled(layer, activations).pow(2).sum(0)


def head_scores(attention: Attention, activations: Activations = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per KV group score ``[kv]``, per query head score ``[kv, groups]``), squared L2 norms.

    A query head's score holds its q rows and output-projection columns; a
    group's adds its k/v rows to its query heads' scores.
    """
    rows = {id(layer): _row_sq(layer, activations) for layer in attention.qkv}
    cols = _col_sq(attention.o, activations)
    kv, g = attention.kv_heads, attention.groups

    def total(kv_head: int, q_heads: list[int]) -> float:
        index = attention.rows_for([kv_head], [q_heads])
        return sum(rows[key][idx].sum().item() for key, idx in index.items()) + \
            cols[attention.o_cols([kv_head], [q_heads])].sum().item()

    shared = torch.tensor([total(i, []) for i in range(kv)])
    q = torch.tensor([[total(i, [j]) - shared[i].item() for j in range(g)] for i in range(kv)])
    return shared + q.sum(1), q


def dim_scores(attention: Attention, activations: Activations = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV group and dim inside its heads, ``[kv, head_dim]`` each: the squared L2 norms of its query and key
    rows (the dims a query-key product reads), and of its value rows and output-projection columns."""
    rows = {id(layer): _row_sq(layer, activations) for layer in attention.qkv}
    cols = _col_sq(attention.o, activations)
    d, everything, nothing = attention.head_dim, torch.arange(attention.head_dim), torch.zeros(0, dtype=torch.long)
    qk, vo = [], []
    for group in range(attention.kv_heads):
        heads = [list(range(attention.groups))]
        for dims, out in (((everything,), (nothing,)), ((nothing,), (everything,))):
            index = attention.rows_for([group], heads, ([*dims], [*out]))
            score = torch.cat([rows[key][idx] for key, idx in index.items()]).view(-1, d).sum(0)
            if out[0].numel():
                score = score + cols[attention.o_cols([group], heads, ([*dims], [*out]))].view(-1, d).sum(0)
            (qk if dims[0].numel() else vo).append(score)
    return torch.stack(qk), torch.stack(vo)


def channel_scores(mlp: Mlp, activations: Activations = None) -> torch.Tensor:
    """Squared L2 norm per intermediate channel: its rows in every expansion plus its projection column."""
    width = mlp.width
    score = _col_sq(mlp.down, activations)
    for layer in mlp.ups:
        sq = _row_sq(layer, activations)
        for part in range(mlp.parts):
            score = score + sq[mlp.up_rows(torch.arange(width))[part::mlp.parts] if mlp.interleaved
                               else mlp.up_rows(torch.arange(width))[part * width:(part + 1) * width]]
    return score


def expert_scores(experts: Experts) -> torch.Tensor:
    """Squared L2 norm per channel of every expert, ``[E, I]``."""
    width, parts = experts.width, experts.parts
    score = getattr(experts.module, experts.down).detach().float().pow(2).sum(1)
    for name in experts.ups:
        sq = getattr(experts.module, name).detach().float().pow(2).sum(2)
        for part in range(parts):
            score = score + (sq[:, part::parts] if experts.interleaved else sq[:, part * width:(part + 1) * width])
    return score
