"""Find the attention and MLP units of a Hugging Face model's repeated blocks.

Blocks are the entries of the ``ModuleList`` (or lists) whose length is the
config's layer count. Inside a block, units are read from one traced forward
pass, never from module names: every module with a 2-D ``weight`` records its
call order and widths, and the sequence is parsed with the config's widths
(hidden ``H``, heads ``h``, KV heads ``kv``, head dim ``d``):

* attention: input projections ``H -> h*d``, ``H -> kv*d`` (x2), or one fused
  ``H -> (h + 2 kv) * d``, closed by an output projection ``h*d -> H``;
* MLP: one or two expansions ``H -> I`` (or a fused ``H -> 2I``), closed by a
  projection ``I -> H``;
* mixture of experts: a module holding 3-D weights ``(E, k*I, H)`` and
  ``(E, H, I)`` (experts stacked), its router left as it is.

Where the row order of a fused weight is not fixed by its shape (q/k/v as
three blocks, or interleaved per KV group; gate/up as halves or interleaved),
each layout is tried: permuting heads (channels) consistently must leave the
block's output unchanged, which only the true layout does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optkit.passes.prune.graph.opaque import select_norm

HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
KV_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def config_int(config: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` holds as an int (aliases included)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass
class Layer:
    """A linear-like module: ``nn.Linear`` (weight ``out x in``) or a transposed one (``in x out``)."""

    module: nn.Module
    name: str
    in_dim: int
    out_dim: int
    out_axis: int

    def select_out(self, rows: torch.Tensor) -> None:
        _select(self.module, "weight", self.out_axis, rows)
        _select(self.module, "bias", 0, rows)
        self.out_dim = len(rows)

    def select_in(self, cols: torch.Tensor) -> None:
        _select(self.module, "weight", 1 - self.out_axis, cols)
        self.in_dim = len(cols)

    def rows(self) -> torch.Tensor:
        """The weight with one row per output channel."""
        weight = self.module.weight.detach()
        return weight if self.out_axis == 0 else weight.t()


def _select(module: nn.Module, name: str, axis: int, index: torch.Tensor) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    data = param.detach().index_select(axis, index.to(param.device)).clone()
    setattr(module, name, nn.Parameter(data, requires_grad=param.requires_grad))


#: Kept dims of each kept KV group's heads: (query/key dims, value/output dims), one index tensor per kept group.
Dims = tuple[list[torch.Tensor], list[torch.Tensor]]


@dataclass
class Attention:
    """Query/key/value projections (three, or one fused with a row layout) and the output projection.

    Heads are *free* when permuting them (in the projections, and in ``head_params``) leaves the block's output
    as it was: any can go from any block. ``shared`` lists the block inputs with a head axis (a position bias
    computed once for every block, as ``(argument index or keyword, axis)``): the same heads must then go from
    every block, and from what computes that input. ``fixed`` marks heads whose position matters beyond
    that (only permuting the dims inside every head keeps the output): heads stay, their dims may narrow.
    """

    qkv: list[Layer]
    o: Layer
    heads: int
    kv_heads: int
    head_dim: int
    layout: str = "separate"  # "separate", "blocks" (q | k | v) or "grouped" (per KV group: q..., k, v)
    # (norm, projection): norms over a separate q or k projection's whole output (OLMo-2's q_norm, k_norm)
    norms: list[tuple[nn.Module, Layer]] = field(default_factory=list)
    # (module, parameter name, axis): per-head parameters beside the projections (Nystromformer's per-head conv)
    head_params: list[tuple[nn.Module, str, int]] = field(default_factory=list)
    shared: list[tuple[int | str, int]] = field(default_factory=list)
    fixed: bool = False
    # separate layout: the indices in ``qkv`` of the query, key and value projections (None: the query is the one
    # as wide as every head, else the first; key and value follow in call order)
    roles: tuple[int, int, int] | None = None

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    def rows_for(self, kept_kv: list[int], kept_q: list[list[int]], dims: Dims | None = None
                 ) -> dict[int, torch.Tensor]:
        """Row indices per input projection keeping KV heads ``kept_kv`` and, per kept group, q heads ``kept_q``.

        ``kept_q[i]`` lists positions (0..groups-1) inside group ``kept_kv[i]``; ``dims`` (all when ``None``) the
        dims kept inside each kept group's heads.
        """
        d, g = self.head_dim, self.groups
        qk, vo = dims if dims is not None else ([None] * len(kept_kv), [None] * len(kept_kv))
        q = [(kv * g + j, qk[i]) for i, (kv, js) in enumerate(zip(kept_kv, kept_q, strict=True)) for j in js]
        k = [(kv, qk[i]) for i, kv in enumerate(kept_kv)]
        v = [(kv, vo[i]) for i, kv in enumerate(kept_kv)]
        if self.layout == "separate":
            rows = dict(zip(self.separate_roles(), (_head_rows(q, d), _head_rows(k, d), _head_rows(v, d)),
                            strict=True))
            return {id(layer): rows[i] for i, layer in enumerate(self.qkv)}
        if self.layout == "blocks":
            key = self.heads * d + _head_rows(k, d)
            return {id(self.qkv[0]): torch.cat([_head_rows(q, d), key, self.heads * d + self.kv_heads * d +
                                                _head_rows(v, d)])}
        rows = []
        for i, (kv, js) in enumerate(zip(kept_kv, kept_q, strict=True)):
            base = kv * (g + 2) * d
            rows += [base + _head_rows([(j, qk[i]) for j in js], d), base + _head_rows([(g, qk[i]), (g + 1, vo[i])], d)]
        return {id(self.qkv[0]): torch.cat(rows)}

    def o_cols(self, kept_kv: list[int], kept_q: list[list[int]], dims: Dims | None = None) -> torch.Tensor:
        g = self.groups
        vo = dims[1] if dims is not None else [None] * len(kept_kv)
        return _head_rows([(kv * g + j, vo[i]) for i, (kv, js) in enumerate(zip(kept_kv, kept_q, strict=True))
                           for j in js], self.head_dim)

    def select(self, kept_kv: list[int], kept_q: list[list[int]], dims: Dims | None = None) -> None:
        """Keep these KV groups, query heads and (optionally) dims in each head; per-head parameters follow."""
        rows = self.rows_for(kept_kv, kept_q, dims)
        for norm, layer in self.norms:
            select_norm(norm, rows[id(layer)].to(norm.weight.device))
        for layer in self.qkv:
            layer.select_out(rows[id(layer)])
        self.o.select_in(self.o_cols(kept_kv, kept_q, dims))
        g = self.groups
        q_heads = torch.tensor([kv * g + j for kv, js in zip(kept_kv, kept_q, strict=True) for j in js])
        for module, name, axis in self.head_params:
            _select(module, name, axis, q_heads)
        self.heads = sum(len(js) for js in kept_q)
        self.kv_heads = len(kept_kv)
        if dims is not None and dims[0]:
            self.head_dim = len(dims[0][0])

    def separate_roles(self) -> tuple[int, int, int]:
        """Indices in ``qkv`` of the query, key and value projections (separate layout)."""
        if self.roles is not None:
            return self.roles
        wide = [i for i, layer in enumerate(self.qkv) if layer.out_dim == self.heads * self.head_dim]
        q = wide[0] if self.kv_heads != self.heads and len(wide) == 1 else 0
        k, v = (i for i in range(len(self.qkv)) if i != q)
        return q, k, v

    def every(self) -> tuple[list[int], list[list[int]]]:
        """``(kept_kv, kept_q)`` that keep every head."""
        return list(range(self.kv_heads)), [list(range(self.groups))] * self.kv_heads

    def layers(self) -> list[Layer]:
        return [*self.qkv, self.o]


def _head_rows(heads: list, head_dim: int) -> torch.Tensor:
    """Rows of ``heads``: head indices, or ``(head, kept dims or None)`` pairs."""
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    pairs = [h if isinstance(h, tuple) else (h, None) for h in heads]
    return torch.cat([h * head_dim + (torch.arange(head_dim) if dims is None else dims.to(torch.long))
                      for h, dims in pairs])


@dataclass
class Mlp:
    """Expansion layers (``fused`` parts stacked in one weight, as halves or interleaved) and the projection."""

    ups: list[Layer]
    down: Layer
    parts: int = 1
    interleaved: bool = False

    @property
    def width(self) -> int:
        return self.down.in_dim

    def up_rows(self, kept: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return kept
        if self.interleaved:
            return torch.stack([kept * self.parts + p for p in range(self.parts)], 1).flatten()
        return torch.cat([kept + p * self.width for p in range(self.parts)])

    def select(self, kept: torch.Tensor) -> None:
        rows = self.up_rows(kept)
        for layer in self.ups:
            layer.select_out(rows)
        self.down.select_in(kept)

    def layers(self) -> list[Layer]:
        return [*self.ups, self.down]


@dataclass
class Experts:
    """Stacked expert weights: ``ups`` are ``(E, parts*I, H)``, ``down`` is ``(E, H, I)``."""

    module: nn.Module
    name: str
    ups: list[str]
    down: str
    parts: int
    interleaved: bool = False

    @property
    def width(self) -> int:
        return getattr(self.module, self.down).shape[2]

    def select(self, kept: torch.Tensor) -> None:
        """Keep channels ``kept[e]`` (an ``E x I'`` index) in every expert ``e``."""
        width, parts = self.width, self.parts
        if parts == 1:
            rows = kept
        elif self.interleaved:
            rows = torch.stack([kept * parts + p for p in range(parts)], 2).flatten(1)
        else:
            rows = torch.cat([kept + p * width for p in range(parts)], 1)
        for name in self.ups:
            _gather(self.module, name, 1, rows)
        _gather(self.module, self.down, 2, kept)


def _gather(module: nn.Module, name: str, axis: int, index: torch.Tensor) -> None:
    param = getattr(module, name)
    shape = list(param.shape)
    shape[axis] = index.shape[1]
    expanded = index.to(param.device).unsqueeze(3 - axis).expand(*shape)
    data = param.detach().gather(axis, expanded).clone()
    setattr(module, name, nn.Parameter(data, requires_grad=param.requires_grad))


@dataclass
class Block:
    """One repeated block: its units, the inputs it was called with, and why parts were left whole."""

    module: nn.Module
    path: str
    attentions: list[Attention] = field(default_factory=list)
    mlps: list[Mlp] = field(default_factory=list)
    experts: list[Experts] = field(default_factory=list)
    # attentions whose heads are not free (shared inputs or fixed positions; see Attention): the in-place engine's
    bound: list[Attention] = field(default_factory=list)
    call: tuple[tuple, dict] | None = None
    skipped: list[str] = field(default_factory=list)
    # the weight-2-D layers its trace recorded, in call order (a block built alike is parsed from them untraced)
    traced: list[Layer] = field(default_factory=list)

    def run(self) -> torch.Tensor:
        """The block's first output on the inputs captured when it was traced."""
        args, kwargs = self.call
        out = self.module(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ``ModuleList``s of repeated blocks: length = the config's layer count, else the longest."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1]
    count = config_int(model.config, LAYER_FIELDS)
    matching = [(n, m) for n, m in lists if len(m) == count]
    if matching:
        return [(n, m) for n, m in matching if not any(n.startswith(o + ".") for o, _ in matching)]
    return sorted(lists, key=lambda item: -len(item[1]))[:1]


def trace(model: nn.Module, inputs: dict[str, Any], blocks: list[Block]) -> dict[int, list[tuple[Layer, torch.Tensor]]]:
    """Run ``model`` once; per block, its weight-2-D modules in call order (first call) with an input sample."""
    calls: dict[int, list[tuple[Layer, torch.Tensor]]] = {id(b.module): [] for b in blocks}
    handles = []
    for block in blocks:
        handles.append(block.module.register_forward_pre_hook(_capture(block), with_kwargs=True))
        seen: set[int] = set()
        for name, module in block.module.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding):
                hook = record_layer(calls[id(block.module)], seen, module, f"{block.path}.{name}")
                handles.append(module.register_forward_hook(hook))
    run_hooked(model, inputs, handles)
    return calls


def _capture(block: Block) -> Callable:
    def hook(module, args, kwargs):
        if block.call is None:
            # A key/value cache would grow on every rerun of the block; reruns go without one.
            block.call = (args, {k: None if hasattr(v, "get_seq_length") else v for k, v in kwargs.items()})
    return hook


def record_layer(calls: list, seen: set[int], module: nn.Module, name: str) -> Callable:
    def hook(mod, args, output):
        if id(mod) in seen or not args or not isinstance(output, torch.Tensor):
            return
        seen.add(id(mod))
        x = args[0]
        weight = mod.weight
        in_dim, out_dim = x.shape[-1], output.shape[-1]
        if isinstance(mod, nn.Linear) or (weight.shape == (out_dim, in_dim) and in_dim != out_dim):
            axis = 0
        elif weight.shape == (in_dim, out_dim) and in_dim != out_dim:
            axis = 1
        elif weight.shape == (in_dim, out_dim):
            axis = 0 if torch.allclose(nn.functional.linear(x, weight), output - _bias(mod), atol=1e-4) else 1
        else:
            return
        calls.append((Layer(module, name, in_dim, out_dim, axis), x))
    return hook


def _bias(module: nn.Module) -> torch.Tensor | float:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else 0.0


def without_cache(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` plus ``use_cache=False`` where the model's forward takes it."""
    import inspect

    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in inputs:
        return {**inputs, "use_cache": False}
    return inputs


def run_hooked(model: nn.Module, inputs: dict[str, Any], handles: list[Any]) -> None:
    """Run ``model`` once on ``inputs`` (no gradients, no cache), then remove ``handles``, the hooks that record
    what it computed."""
    try:
        with torch.no_grad():
            model(**without_cache(model, inputs))
    finally:
        for handle in handles:
            handle.remove()
