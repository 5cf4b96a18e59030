"""Prune a Hugging Face transformer one block at a time, in bounded memory, with statistics in fp32.

The way methods that prune 7-70 B models work: the calibration inputs of the
first block are captured once; then each block in turn is moved to the compute
device as an fp32 copy of its weights, its structure is found and checked there
(layouts by permutation, :mod:`.parse`), its statistics are taken on the cached
inputs (each layer's input norms, the inputs of the layers that lose some), its
heads and MLP channels are chosen and cut, the narrowed layers are refitted by
least squares (:mod:`.least_squares`), and its outputs become the
next block's inputs. The block then goes back where it was, in the dtype it had.
Only one block is ever held in fp32, so a bf16 model is cut exactly where its
fp32 copy would be, and peak memory is the model as loaded plus one block.

What is cut is a :class:`Plan` (KV groups kept, query heads kept per group,
MLP widths kept), checked against the stock class before anything is cut
(:func:`check_plan`): a plan the stock config cannot describe changes nothing.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optkit.core.errors import OptkitError, first_line
from optkit.core.progress import progress
from optkit.model.pages import evict_clean, file_storages, release
from optkit.passes.prune.hf.importance import channel_scores, head_scores
from optkit.passes.prune.hf.least_squares import LayerInputs, keeps_rows, refit_layer
from optkit.passes.prune.hf.parse import parse_block
from optkit.passes.prune.hf.structure import (
    HEAD_FIELDS, HIDDEN_FIELDS, KV_FIELDS, Block, Layer, config_int, find_block_lists, record_layer, without_cache,
)

__all__ = ["INPUTS_FROM", "Captured", "Plan", "Stats", "Sweep", "capture_inputs", "chained_blocks", "check_plan", "cut",
           "device_of", "edited_config", "full_plan", "head_options", "leave", "narrowed", "outputs", "parse_first",
           "plan_for", "planned_size", "prune_blockwise", "statistics", "uniform_plan", "visit"]

#: Blocks of at least this many parameters have Python's cyclic garbage collected as they are left (see leave).
COLLECT_ABOVE_PARAMS = 4_000_000
#: Where each block's calibration inputs come from: the pruned blocks before it, or the unpruned ones.
INPUTS_FROM = ("pruned", "unpruned")


@dataclass(frozen=True)
class Plan:
    """The widths every block keeps.

    Attributes:
        kv_keep: key/value groups kept (all of them when only query heads go).
        q_keep: query heads kept in each kept group.
        mlp_keep: MLP width -> kept width (one entry per distinct width).
    """

    kv_keep: int
    q_keep: int
    mlp_keep: dict[int, int] = field(default_factory=dict)

    def heads(self) -> int:
        """Query heads kept."""
        return self.kv_keep * self.q_keep

    def describe(self, heads: int, kv: int) -> str:
        """One line: the heads and MLP widths before and after."""
        widths = ", ".join(f"{w}->{k}" for w, k in self.mlp_keep.items() if k != w) or "kept"
        return f"heads {heads}->{self.heads()} (kv {kv}->{self.kv_keep}), MLP widths {widths}"


@dataclass
class Captured:
    """A block's calibration inputs, one ``(args, kwargs)`` per batch, float tensors in fp32 on the host."""

    calls: list[tuple[tuple, dict]]

    def on(self, device: torch.device) -> Iterable[tuple[tuple, dict]]:
        """Each call with its tensors on ``device``, one at a time."""
        for args, kwargs in self.calls:
            yield _map_tensors(args, device), _map_tensors(kwargs, device)


class _Stop(Exception):
    """Raised by the capture hook: the rest of the model need not run."""


def capture_inputs(model: nn.Module, blocks: nn.ModuleList, batches: Sequence[dict[str, Any]]) -> Captured:
    """The first block's inputs on every batch (the model runs up to that block only), float tensors in fp32.

    Raises:
        OptkitError: when a batch does not reach the first block.
    """
    calls: list[tuple[tuple, dict]] = []

    def hook(module, args, kwargs):
        calls.append((_map_tensors(args, "cpu", torch.float32), _map_tensors(_no_cache(kwargs), "cpu", torch.float32)))
        raise _Stop

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    upcast = embeddings is not None and _feeds_first_block(model, embeddings, blocks)
    handles = [blocks[0].register_forward_pre_hook(hook, with_kwargs=True)]
    if upcast:
        # What the model derives from the embeddings' dtype on the way to the first block (rotary tables, the
        # attention mask) is then made in fp32 too, as in the model's fp32 copy.
        handles.append(embeddings.register_forward_hook(lambda module, args, output: output.float()))
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(**without_cache(model, batch))
                except _Stop:
                    continue
    finally:
        for handle in handles:
            handle.remove()
    if len(calls) != len(batches):
        raise OptkitError(f"{len(batches) - len(calls)} of {len(batches)} calibration batches never reached the "
                          "model's first block")
    return Captured(calls)


def _feeds_first_block(model: nn.Module, embeddings: nn.Module, blocks: nn.ModuleList) -> bool:
    """Whether the input embeddings' output reaches the first block unchanged (no norm or sum on the way, which
    would mix dtypes if it were fp32). Only token embeddings are probed: an image model's patch embeddings are
    a convolution whose output is its own dtype's already."""
    if not isinstance(embeddings, nn.Embedding):
        return False
    seen: dict[str, torch.Tensor] = {}

    def embedded(module, args, output):
        seen["embedded"] = output

    def first(module, args, kwargs):
        seen["first"] = args[0] if args else next(iter(kwargs.values()))
        raise _Stop

    handles = [embeddings.register_forward_hook(embedded), blocks[0].register_forward_pre_hook(first, with_kwargs=True)]
    vocab = embeddings.weight.shape[0]
    try:
        with torch.no_grad():
            model(**without_cache(model, {"input_ids": torch.arange(min(4, vocab)).unsqueeze(0).to(embeddings.weight.device)}))
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - a model this probe cannot run is simply not given fp32 embeddings
        return False
    finally:
        for handle in handles:
            handle.remove()
    return "embedded" in seen and seen.get("first") is seen["embedded"]


def head_options(heads: int, kv: int) -> list[tuple[int, int]]:
    """Every ``(kv groups kept, query heads kept per group)`` with something removed: whole groups, or the same
    number of query heads from every group (grouped-query attention; plain multi-head attention is one head a
    group). Largest first."""
    groups = heads // kv
    options = {(k, groups) for k in range(1, kv)} | {(kv, q) for q in range(1, groups)}
    return sorted(options, key=lambda o: (-o[0] * o[1], -o[0]))


def check_plan(model: nn.Module, plan: Plan, structure: Block) -> str | None:
    """``None`` when the stock class built from the edited config has exactly the shapes ``plan`` gives;
    else why not, in one line. Nothing of ``model`` changes.

    ``structure`` is one parsed block (the model's first); the plan is applied to a copy of its shapes on the meta
    device, and every block is assumed to be built alike (they are instances of one class).
    """
    from optkit.io.hf import stock_class

    attention = structure.attentions[0] if structure.attentions else None
    if attention is not None and not (1 <= plan.kv_keep <= attention.kv_heads and 1 <= plan.q_keep <= attention.groups):
        return (f"the plan keeps {plan.kv_keep} key/value groups of {plan.q_keep} query heads; the model has "
                f"{attention.kv_heads} groups of {attention.groups}")
    if any(not 1 <= kept <= width for width, kept in plan.mlp_keep.items()):
        return f"the plan keeps MLP widths {plan.mlp_keep}: each must be between 1 and the width"
    config = edited_config(model.config, plan, structure)
    try:
        type(config).from_dict(config.to_dict())
        with torch.device("meta"):
            fresh = stock_class(model)(config)
    except Exception as error:  # noqa: BLE001 - any refusal of the config is the answer
        return f"the stock class refuses the config ({type(error).__name__}: {first_line(error)})"
    expected = _expected_shapes(model, plan, structure)
    theirs = {n: tuple(p.shape) for n, p in fresh.named_parameters(remove_duplicate=False)}
    for name in sorted(set(expected) | set(theirs)):
        if expected.get(name) != theirs.get(name):
            return f"{name}: pruned {expected.get(name)}, stock {theirs.get(name)}"
    return None


def edited_config(config: Any, plan: Plan, structure: Block) -> Any:
    """A copy of ``config`` stating ``plan``'s head counts and MLP widths."""
    from optkit.passes.prune.hf.transformer import set_by_value, set_width

    attention = structure.attentions[0] if structure.attentions else None
    edited = copy.deepcopy(config)
    if attention is not None:
        set_by_value(edited, HEAD_FIELDS, attention.heads, plan.heads())
        set_by_value(edited, KV_FIELDS, attention.kv_heads, plan.kv_keep)
        if getattr(edited, "head_dim", None) is None and config_int(edited, HIDDEN_FIELDS) // plan.heads() != \
                attention.head_dim:
            edited.head_dim = attention.head_dim
    for old, kept in plan.mlp_keep.items():
        if kept != old:
            set_width(edited, old, kept)
    return edited


def _expected_shapes(model: nn.Module, plan: Plan, structure: Block) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape once ``plan`` is cut in every block (block parameters by their name in a block)."""
    trial = _meta_copy(structure)
    cut(trial, plan, activations=None, shapes_only=True)
    per_block = {n: tuple(p.shape) for n, p in trial.module.named_parameters(remove_duplicate=False)}
    shapes = {}
    lists = [name for name, _ in find_block_lists(model)]
    for name, param in model.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(param.shape)
        for prefix in lists:
            if name.startswith(prefix + "."):
                inner = name[len(prefix) + 1:].partition(".")[2]
                shapes[name] = per_block.get(inner, shapes[name])
    return shapes


@dataclass
class Sweep:
    """One pass over the blocks: what it measured and cut.

    Attributes:
        seconds: wall time of the sweep.
        blocks: blocks visited.
        refitted: names of the layers refitted.
        errors: per block, the relative output error of its refitted layers (``{layer: error}``).
    """

    seconds: float = 0.0
    blocks: int = 0
    refitted: list[str] = field(default_factory=list)
    errors: list[dict[str, float]] = field(default_factory=list)


def prune_blockwise(model: nn.Module, plan: Plan, batches: Sequence[dict[str, Any]], *,
                    device: torch.device | str | None = None,
                    importance: str = "l1", refit: bool = True, inputs_from: str = "unpruned",
                    structure: Block | None = None, stage: str = "structured_prune") -> Sweep:
    """Cut ``plan`` in every block of ``model`` (in place), one block at a time on ``device``.

    Args:
        model: a Hugging Face transformer with one list of repeated blocks; stays where it is, in its dtype.
        plan: the widths to keep, checked with :func:`check_plan` first.
        batches: forward keywords (``input_ids``, ``attention_mask``) of calibration text, or example inputs.
        device: where each block is computed (``None``: where the model is).
        importance: ``l1`` (weight norms) or ``activation`` (weight x input norm on ``batches``).
        refit: refit the layers that lose inputs by least squares on ``batches``.
        inputs_from: ``pruned`` (each block sees the pruned blocks' outputs) or ``unpruned``.
        structure: the first block as :func:`parse_first` found it, where the caller has it already.
        stage: the name progress lines are shown under.

    Returns:
        what the sweep did (:class:`Sweep`); the config states the new widths.

    Raises:
        OptkitError: when the model has no single chain of blocks, or a block's structure differs from the plan's.
    """
    if inputs_from not in INPUTS_FROM:
        raise ValueError(f"inputs_from must be one of {INPUTS_FROM}, got {inputs_from!r}")
    start = time.perf_counter()
    blocks = chained_blocks(model)
    target = torch.device(device) if device else device_of(model)
    evict_clean(model)  # a memory-mapped checkpoint's pages come back one block at a time, as each is reached
    captured = capture_inputs(model, blocks, batches)
    structure = structure or parse_first(model, blocks, captured, target)
    problem = check_plan(model, plan, structure)
    if problem is not None:
        attention = structure.attentions[0]
        raise OptkitError(f"the stock class cannot describe {plan.describe(attention.heads, attention.kv_heads)}: "
                          f"{problem}")
    sweep = Sweep()
    path = find_block_lists(model)[0][0]
    settings = changed_settings(model, plan, structure)
    shown = progress(stage, "blocks pruned", len(blocks))
    for index, module in enumerate(blocks):
        block = visit(module, f"{path}.{index}", captured, target, model.config, structure)
        try:
            stats = statistics(block, captured, target, refit=refit, keep_outputs=inputs_from == "unpruned")
            before = stats.outputs
            originals = {id(layer): layer.module.weight.detach().clone() for layer in narrowed(block)}
            kept = cut(block, plan, stats.norms if importance == "activation" else None)
            adopt_settings(block.module, settings)
            if refit:
                errors = {}
                for layer in narrowed(block):
                    gathered = stats.inputs.pop(layer.name, None)  # freed once used
                    if gathered is not None:
                        errors[layer.name] = refit_layer(layer, originals[id(layer)], kept[id(layer)], gathered)
                        sweep.refitted.append(layer.name)
                sweep.errors.append(errors)
            captured = Captured(before) if before is not None else outputs(block, captured, target)
        finally:
            leave(block)
        sweep.blocks += 1
        shown.step()
    _write_config(model, plan, structure)
    sweep.seconds = time.perf_counter() - start
    return sweep


def chained_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's one list of repeated blocks, each fed the previous one's output.

    Raises:
        OptkitError: for a model with several block lists (an encoder and a decoder) or none.
    """
    lists = find_block_lists(model)
    if len(lists) != 1:
        raise OptkitError(f"block-by-block pruning needs one list of repeated blocks; {type(model).__name__} has "
                          f"{len(lists)}")
    return lists[0][1]


def parse_first(model: nn.Module, blocks: nn.ModuleList, captured: Captured, device: torch.device) -> Block:
    """The first block's units, found on an fp32 copy of it (the model is not changed).

    The copy is kept in the block's own dtype and place once parsed: what is read from it later is its layouts
    and shapes (and a trial cut of them), so it need not hold a second fp32 block through a sweep.
    """
    path = find_block_lists(model)[0][0]
    home = next(blocks[0].parameters())
    copy_of_first = copy.deepcopy(blocks[0]).to(device=device, dtype=torch.float32)
    structure = _parse(copy_of_first, f"{path}.0", captured, device, model.config)
    copy_of_first.to(device=home.device, dtype=home.dtype)
    return structure


def _parse(module: nn.Module, path: str, captured: Captured, device: torch.device, config: Any,
           like: Block | None = None) -> Block:
    hidden, heads = config_int(config, HIDDEN_FIELDS), config_int(config, HEAD_FIELDS)
    kv = config_int(config, KV_FIELDS) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    block = Block(module, path)
    block.call = next(iter(captured.on(device)))
    calls = _calls_like(module, path, like) if like is not None else None
    if calls is None:
        calls = []
        seen: set[int] = set()
        handles = []
        for name, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(sub, nn.Embedding):
                handles.append(sub.register_forward_hook(record_layer(calls, seen, sub, f"{path}.{name}")))
        try:
            with torch.no_grad():
                block.run()
        finally:
            for handle in handles:
                handle.remove()
    block.traced = [layer for layer, _ in calls]
    parse_block(block, calls, hidden, heads, kv, head_dim, like=like)
    return block


def _calls_like(module: nn.Module, path: str, like: Block) -> list[tuple[Layer, None]] | None:
    """The layers ``like``'s trace recorded, found by the same names and weight shapes in ``module`` (a block of the
    same class calls them in the same order, so it need not be run to find them); ``None`` where one differs."""
    calls = []
    for layer in like.traced:
        relative = layer.name[len(like.path) + 1:]
        try:
            sub = module.get_submodule(relative)
        except AttributeError:
            return None
        shape = (layer.out_dim, layer.in_dim) if layer.out_axis == 0 else (layer.in_dim, layer.out_dim)
        weight = getattr(sub, "weight", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
            return None
        calls.append((Layer(sub, f"{path}.{relative}", layer.in_dim, layer.out_dim, layer.out_axis), None))
    return calls


def visit(module: nn.Module, path: str, captured: Captured, device: torch.device, config: Any,
           structure: Block) -> Block:
    """Move ``module`` to ``device`` in fp32 and parse it like the first block (``structure``: its layouts are
    taken, not checked again); it must have the first block's units."""
    home = next(module.parameters())
    module._optkit_home = (home.device, home.dtype)
    module._optkit_mapped = file_storages(module)
    module.to(device=device, dtype=torch.float32)
    release(module._optkit_mapped)  # the checkpoint's pages of weights just copied are not read again
    block = _parse(module, path, captured, device, config, like=structure)
    if (len(block.attentions), len(block.mlps)) != (len(structure.attentions), len(structure.mlps)) or block.experts:
        leave(block)
        raise OptkitError(f"{path} has {len(block.attentions)} attention and {len(block.mlps)} MLP units where the "
                          f"first block has {len(structure.attentions)} and {len(structure.mlps)}; "
                          "block-by-block pruning needs every block built alike")
    return block


def leave(block: Block) -> None:
    """Put a visited block back where it was, in the dtype it had."""
    home_device, home_dtype = block.module.__dict__.pop("_optkit_home")
    block.module.to(device=home_device, dtype=home_dtype)
    release(block.module.__dict__.pop("_optkit_mapped"))  # an fp32 checkpoint's weights, replaced by the cut
    block.call = None
    # Reference cycles left by a block's run can hold its fp32 activations until Python's collector next looks at
    # its oldest generation: Llama-3.2-1B's sweep reached 7.7 GB that way where collecting here keeps it at 4.1 GB,
    # for about 0.1 s a block (spent only on blocks large enough for that to matter).
    if sum(p.numel() for p in block.module.parameters()) >= COLLECT_ABOVE_PARAMS:
        gc.collect()


@dataclass
class Stats:
    """A block's statistics on its calibration inputs: each layer's input RMS per channel (``norms``), the inputs
    of the layers that may lose some, gathered for their refit (``inputs``), and its outputs when kept (the next
    block's inputs)."""

    norms: dict[str, torch.Tensor]
    inputs: dict[str, LayerInputs]
    outputs: list[tuple[tuple, dict]] | None


def statistics(block: Block, captured: Captured, device: torch.device, *, refit: bool,
               keep_outputs: bool) -> Stats:
    """Input norms of every layer, the gathered inputs of the layers that may lose some (with ``refit``), and
    (optionally) the block's outputs, over every cached call."""
    layers = {id(layer.module): layer for unit in (*block.attentions, *block.mlps) for layer in unit.layers()}
    narrowing = {id(layer.module) for layer in narrowed(block)} if refit else set()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    gathered: dict[str, LayerInputs] = {}

    def given(module, args):
        layer = layers[id(module)]
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        sums[layer.name] = sums.get(layer.name, 0) + x.pow(2).sum(0)
        counts[layer.name] = counts.get(layer.name, 0) + len(x)
        if id(module) in narrowing:
            if layer.name not in gathered:
                gathered[layer.name] = LayerInputs(x.shape[1], keep_rows=keeps_rows(module))
            gathered[layer.name].add_input(x, args[0])

    def produced_by(module, args, out):
        bias = getattr(module, "bias", None)
        gathered[layers[id(module)].name].add_output(out.detach().reshape(-1, out.shape[-1]), bias)

    handles = [layer.module.register_forward_pre_hook(given) for layer in layers.values()]
    handles += [layers[key].module.register_forward_hook(produced_by) for key in narrowing]
    produced = [] if keep_outputs else None
    try:
        with torch.no_grad():
            for args, kwargs in captured.on(device):
                out = block.module(*args, **kwargs)
                if produced is not None:
                    produced.append(_next_call(out, args, kwargs))
    finally:
        for handle in handles:
            handle.remove()
    norms = {name: (total / counts[name]).sqrt().cpu() for name, total in sums.items()}
    return Stats(norms, gathered, produced)


def outputs(block: Block, captured: Captured, device: torch.device) -> Captured:
    """The next block's inputs: ``block`` run on every cached call."""
    calls = []
    with torch.no_grad():
        for args, kwargs in captured.on(device):
            calls.append(_next_call(block.module(*args, **kwargs), args, kwargs))
    return Captured(calls)


def _next_call(out: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The next block's call: this block's hidden states in place of its own, the other inputs as they were."""
    hidden = out[0] if isinstance(out, tuple) else out
    hidden = hidden.detach().to("cpu", torch.float32)
    if args:
        return (hidden, *_map_tensors(args[1:], "cpu")), _map_tensors(kwargs, "cpu")
    key = next(iter(kwargs))
    return (), {**_map_tensors(kwargs, "cpu"), key: hidden}


def narrowed(block: Block) -> list[Layer]:
    """The layers that read heads or MLP channels: attention output and MLP down projections."""
    return [*(a.o for a in block.attentions), *(m.down for m in block.mlps)]


def cut(block: Block, plan: Plan, activations: dict[str, torch.Tensor] | None, *,
        shapes_only: bool = False) -> dict[int, torch.Tensor]:
    """Cut ``plan`` in ``block``'s units by importance; the input columns each narrowed layer keeps.

    ``shapes_only`` keeps the first heads and channels instead of scoring them: the same shapes, without reading
    a weight (for a copy on the meta device).
    """
    kept: dict[int, torch.Tensor] = {}
    for attention in block.attentions:
        group_score, q_score = (None, None) if shapes_only else head_scores(attention, activations)
        groups = attention.groups
        if plan.kv_keep < attention.kv_heads:
            kept_kv = _top(group_score, plan.kv_keep)
            kept_q = [list(range(groups))] * plan.kv_keep
        else:
            kept_kv = list(range(attention.kv_heads))
            kept_q = [_top(None if q_score is None else q_score[i], plan.q_keep) for i in kept_kv]
        kept[id(attention.o)] = attention.o_cols(kept_kv, kept_q)
        attention.select(kept_kv, kept_q)
    for mlp in block.mlps:
        width = plan.mlp_keep.get(mlp.width, mlp.width)
        channels = (torch.arange(width) if shapes_only
                    else channel_scores(mlp, activations).topk(width).indices.sort().values)
        kept[id(mlp.down)] = channels
        mlp.select(channels)
    return kept


def _top(scores: torch.Tensor | None, count: int) -> list[int]:
    """The positions of the ``count`` highest ``scores``, ascending; the first ``count`` positions without scores."""
    return list(range(count)) if scores is None else sorted(scores.topk(count).indices.tolist())


def _meta_copy(block: Block) -> Block:
    """A copy of ``block`` whose module's parameters and buffers are on the meta device (shapes, no data)."""
    memo: dict[int, Any] = {}
    for param in block.module.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    for buffer in block.module.buffers():
        memo[id(buffer)] = buffer.to("meta")
    return copy.deepcopy(block, memo)


def _write_config(model: nn.Module, plan: Plan, structure: Block) -> None:
    from optkit.passes.prune.hf.transformer import matches_stock

    edited = edited_config(model.config, plan, structure)
    vars(model.config).clear()
    vars(model.config).update(vars(edited))
    for module in model.modules():
        for key, value in vars(module).items():
            if isinstance(value, type(model.config)) and value is not model.config:
                vars(module)[key] = model.config
    problem = matches_stock(model)
    if problem is not None:
        raise OptkitError(f"after the cut the stock class no longer describes the model: {problem}")


def device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter is."""
    return next(model.parameters()).device


def _no_cache(kwargs: dict) -> dict:
    return {k: None if hasattr(v, "get_seq_length") else v for k, v in kwargs.items()}


def _map_tensors(value: Any, device: Any, float_dtype: torch.dtype | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = float_dtype if float_dtype is not None and value.is_floating_point() else value.dtype
        return value.detach().to(device=device, dtype=dtype)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, device, float_dtype) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, device, float_dtype) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, device, float_dtype) for k, v in value.items()}
    return value


def plan_for(structure: Block, heads_ratio: float, mlp_ratio: float, round_to: int) -> Plan:
    """The uniform plan for shares of heads and MLP channels: whole key/value groups where the share removes
    one, else the same number of query heads from every group; MLP widths rounded to ``round_to``."""
    from optkit.passes.prune.hf.transformer import kept_width

    kv_keep = q_keep = None
    if structure.attentions:
        attention = structure.attentions[0]
        kv, groups = attention.kv_heads, attention.groups
        kv_keep, q_keep = kv, groups
        if heads_ratio > 0:
            if kv > 1 and round(kv * heads_ratio) >= 1:
                kv_keep = max(1, kv - round(kv * heads_ratio))
            elif groups > 1:
                q_keep = max(1, groups - round(groups * heads_ratio))
    widths = sorted({mlp.width for mlp in structure.mlps})
    mlp_keep = {w: kept_width(w, mlp_ratio, round_to) if mlp_ratio > 0 else w for w in widths}
    return Plan(kv_keep or 0, q_keep or 0, mlp_keep)


def full_plan(structure: Block) -> Plan:
    """The plan that keeps everything."""
    return plan_for(structure, 0.0, 0.0, 1)


def planned_size(model: nn.Module, plan: Plan, structure: Block, measured: str = "params") -> int:
    """The parameters (``params``) or linear-layer weights per token (``macs``) of the stock class built, on the
    meta device, from the config ``plan`` gives: what the model will have once ``plan`` is cut."""
    from optkit.io.hf import stock_class

    with torch.device("meta"):
        fresh = stock_class(model)(edited_config(model.config, plan, structure))
    if measured == "params":
        return sum(p.numel() for p in fresh.parameters())
    return sum(m.weight.numel() for m in fresh.modules()
               if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
               and not isinstance(m, nn.Embedding))


def uniform_plan(model: nn.Module, structure: Block, heads_ratio: float, mlp_ratio: float,
                 round_to: int) -> tuple[Plan | None, str | None]:
    """:func:`plan_for`'s plan if the stock class describes it, else the same MLP cut with every head kept.

    Returns:
        ``(plan, note)``: the note (one line) says why the heads were kept; ``(None, why)`` when neither plan
        can be described.
    """
    plan = plan_for(structure, heads_ratio, mlp_ratio, round_to)
    problem = check_plan(model, plan, structure)
    if problem is None:
        return plan, None
    whole = full_plan(structure)
    heads_kept = Plan(whole.kv_keep, whole.q_keep, plan.mlp_keep)
    if heads_kept != plan and check_plan(model, heads_kept, structure) is None:
        return heads_kept, f"every head kept: {plan.heads()} heads are refused ({problem})"
    return None, problem


def fit_mlp(model: nn.Module, structure: Block, kv_keep: int, q_keep: int, fraction: float, measured: str,
            round_to: int, max_share: float = 0.9) -> tuple[Plan, float] | None:
    """The plan with these head counts whose MLP width brings the size (``params`` or ``macs``) to ``fraction``
    of the unpruned model's, and the fraction it plans; ``None`` when the stock class refuses it.

    The size falls linearly with the MLP width, so two stock classes built on the meta device give it; the
    width is rounded to ``round_to`` and at most ``max_share`` of it goes.
    """
    from optkit.passes.prune.hf.transformer import kept_width

    whole = full_plan(structure)
    full = planned_size(model, whole, structure, measured)
    at_full = planned_size(model, Plan(kv_keep, q_keep, whole.mlp_keep), structure, measured)
    half = {w: w // 2 for w in whole.mlp_keep}
    at_half = planned_size(model, Plan(kv_keep, q_keep, half), structure, measured)
    per_channel = (at_full - at_half) / max(sum(w - h for w, h in zip(whole.mlp_keep, half.values(), strict=True)), 1)
    removed = (at_full - fraction * full) / per_channel if per_channel > 0 else 0.0
    share = min(max(removed / max(sum(whole.mlp_keep), 1), 0.0), max_share)
    plan = Plan(kv_keep, q_keep, {w: kept_width(w, share, round_to) if share > 0 else w for w in whole.mlp_keep})
    if check_plan(model, plan, structure) is not None:
        return None
    return plan, planned_size(model, plan, structure, measured) / full


def changed_settings(model: nn.Module, plan: Plan, structure: Block) -> dict[str, dict[str, Any]]:
    """The scalar module settings a block's modules take from the config that the plan changes (an attention's
    head count, its KV groups), as the stock class sets them: ``{module name in a block: {attribute: value}}``.
    A module that keeps the config itself and reads it as it runs (Phi-3's attention) is given the edited config.

    A cut block takes them at once (:func:`adopt_settings`), so that it runs, for the next block's inputs, as the
    stock class built from the edited config would run it; :func:`_write_config` then points such modules back at
    the model's config, edited by then.
    """
    from optkit.io.hf import stock_class
    from optkit.passes.prune.hf.transformer import is_setting

    with torch.device("meta"):
        before = stock_class(model)(model.config)
        after = stock_class(model)(edited_config(model.config, plan, structure))
    old = dict(find_block_lists(before)[0][1][0].named_modules())
    changes: dict[str, dict[str, Any]] = {}
    for name, module in find_block_lists(after)[0][1][0].named_modules():
        previous = vars(old[name]) if name in old else {}
        for key, value in vars(module).items():
            settable = is_setting(value) or isinstance(value, type(model.config))
            if not key.startswith("_") and key != "training" and settable and previous.get(key) != value:
                changes.setdefault(name, {})[key] = value
    return changes


def adopt_settings(block: nn.Module, changes: dict[str, dict[str, Any]]) -> None:
    """Set :func:`changed_settings` on a cut block's modules."""
    modules = dict(block.named_modules())
    for name, settings in changes.items():
        if name in modules:
            vars(modules[name]).update(settings)
