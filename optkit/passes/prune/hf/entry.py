"""A Hugging Face transformer's prune to uniform widths: what :func:`~optkit.passes.prune.graph.channels.prune_to`
calls for one.

Block by block (:mod:`.blockwise`) where the model is one chain of alike blocks and the stock class
describes the widths asked for: statistics in fp32, one block at a time, the model kept in its dtype.
Otherwise (depth pruning, a class whose head width is ``hidden / heads``, encoder-decoder stacks) the
in-place engine (:mod:`.transformer`), which also narrows the residual stream where the stock class needs it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError
from optkit.passes.prune.hf.calibration import calibration_text, example_keywords

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.prune.spec import PruneSpec, Widths
    from optkit.passes.prune.hf.blockwise import Plan
    from optkit.passes.prune.hf.structure import Block

def prune_transformer_to(model: nn.Module, spec: PruneSpec, widths: Widths) -> dict[str, Any]:
    """Whole heads, MLP channels (and with ``drop_blocks``, blocks), uniform across blocks, config updated.

    The stock ``transformers`` class still describes the result, so it is saved with ``save_pretrained``
    and reloads with ``from_pretrained``.

    Raises:
        ValueError: for settings that apply to channel pruning only, or activation importance without text.
    """
    unsupported = [name for name, value in (("ignored_layers", spec.ignored_layers),
                                            ("layer_ratios", widths.per_group),
                                            ("allocation", widths.global_),
                                            ("importance", spec.importance not in ("l1", "activation")),
                                            ("iterative_steps", widths.steps != 1)) if value]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} apply to channel pruning with torch-pruning; a transformer's "
                         "heads, MLP channels and blocks are pruned uniformly by weight norm (importance l1) "
                         "or by weight x activation norm (importance activation): leave the others at their "
                         "defaults (or set submodule to prune a part of it channel by channel)")
    keywords = example_keywords(model, spec)
    batches = calibration_text(model, spec)
    if spec.importance == "activation" and batches is None:
        raise ValueError("importance 'activation' measures activations on calibration text: give data as a text "
                         "spec (text, text:FILE or text:DIR)")
    heads_ratio = widths.ratio if widths.heads_ratio is None else widths.heads_ratio
    structure = first_block(model, keywords) if not spec.drop_blocks else None
    if structure is not None:
        from optkit.passes.prune.hf.blockwise import uniform_plan

        plan, note = uniform_plan(model, structure, heads_ratio, widths.ratio, widths.round_to)
        if plan is not None:
            details = prune_planned(model, spec, plan, structure, batches=batches, keywords=keywords)
            details["ratio"] = widths.ratio
            if note is not None:
                details["notes"].append(f"structured_prune {note}")
            return details
    return _prune_in_place(model, spec, widths, heads_ratio, keywords, batches)


def first_block(model: nn.Module, keywords: dict[str, Any]) -> Block | None:
    """The first block's parsed units (on an fp32 copy), when the block-by-block prune can take the model:
    one chain of blocks, each with attention and an MLP; ``None`` otherwise."""
    from optkit.passes.prune.hf import blockwise

    try:
        blocks = blockwise.chained_blocks(model)
        structure = blockwise.parse_first(model, blocks, blockwise.capture_inputs(model, blocks, [keywords]),
                                          blockwise.device_of(model))
    except OptkitError:
        return None
    if not structure.attentions or not structure.mlps or structure.experts or not _chained(model, blocks, keywords):
        return None
    return structure


def _chained(model: nn.Module, blocks: nn.ModuleList, keywords: dict[str, Any]) -> bool:
    """Whether each block's first input is the previous block's output (one residual stream, no skips)."""
    from optkit.passes.prune.hf.structure import run_hooked

    if len(blocks) < 2:
        return True
    seen: dict[int, Any] = {}

    def output(index: int):
        def hook(module, args, out):
            seen[("out", index)] = out[0] if isinstance(out, tuple) else out
        return hook

    def given(index: int):
        def hook(module, args, kwargs):
            seen[("in", index)] = args[0] if args else next(iter(kwargs.values()), None)
        return hook

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_hook(output(index)))
        handles.append(block.register_forward_pre_hook(given(index), with_kwargs=True))
    run_hooked(model, keywords, handles)
    return all(seen.get(("in", i + 1)) is seen.get(("out", i)) and seen.get(("out", i)) is not None
               for i in range(len(blocks) - 1))


def prune_planned(model: nn.Module, spec: PruneSpec, plan: Plan, structure: Block, *,
                  batches: list[dict[str, Any]] | None = None, keywords: dict[str, Any] | None = None) -> dict[str, Any]:
    """Cut ``plan`` (one the stock class describes) block by block, in place, with ``spec``'s importance, on its
    calibration text (``batches``, read from ``spec`` when not given) and refit where ``spec`` asks; without
    text, on the example inputs (``keywords``) and without refit.

    Returns:
        the prune's details for the report.
    """
    from optkit.passes.prune.hf import blockwise

    batches = batches if batches is not None else calibration_text(model, spec)
    refit = batches is not None and spec.bias_correction
    if batches is None:
        batches = [keywords if keywords is not None else example_keywords(model, spec)]

    attention = structure.attentions[0]
    before = _summary(model, attention.heads, attention.kv_heads, sorted(plan.mlp_keep))
    sweep = blockwise.prune_blockwise(model, plan, batches, importance=spec.importance, refit=refit,
                                      inputs_from=spec.block_inputs, device=compute_device(model, spec),
                                      structure=structure)
    after = _summary(model, plan.heads(), plan.kv_keep, sorted(plan.mlp_keep.values()))
    units = sweep.blocks * len(structure.attentions)
    after["attention_units"] = before["attention_units"] = units
    notes = []
    if sweep.refitted:
        notes.append(f"structured_prune refitted {len(sweep.refitted)} layer(s) that lost inputs (attention output and "
                     "MLP down projections) by least squares on the calibration text")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = {"before": before, "after": after, "dropped_blocks": [], "skipped": [], "engine": "blockwise",
              "dtype": dtype, "seconds": round(sweep.seconds, 2), "block_inputs": spec.block_inputs}
    return {"importance": spec.importance, "refitted_layers": sweep.refitted, "transformer": result,
            "pruned_layers": units, "skipped_layers": {}, "notes": notes,
            "refit_errors": [{name: round(error, 6) for name, error in block.items()} for block in sweep.errors]}


def compute_device(model: nn.Module, spec: PruneSpec):
    """Where blocks are computed: ``spec.device`` resolved (``auto``: CUDA, then MPS, then CPU), else where the
    model is."""
    from optkit.passes.device.passes import resolve_device
    from optkit.passes.prune.hf.blockwise import device_of

    return device_of(model) if spec.device is None else resolve_device(spec.device)


def _summary(model: nn.Module, heads: int, kv: int, widths: list[int]) -> dict[str, Any]:
    from optkit.passes.prune.hf.structure import HIDDEN_FIELDS, LAYER_FIELDS, config_int

    return {"heads": heads, "kv_heads": kv, "intermediate": widths, "hidden": config_int(model.config, HIDDEN_FIELDS),
            "layers": config_int(model.config, LAYER_FIELDS), "params": sum(p.numel() for p in model.parameters())}


def _prune_in_place(model: nn.Module, spec: PruneSpec, widths: Widths, heads_ratio: float,
                    keywords: dict[str, Any], batches: list[dict[str, Any]] | None) -> dict[str, Any]:
    from optkit.passes.prune.hf import prune_transformer
    from optkit.passes.prune.hf.calibration import input_norms
    from optkit.passes.prune.hf.refit import refit_narrowed_layers

    ratio = widths.ratio
    activations = input_norms(model, batches) if spec.importance == "activation" else None
    original = copy.deepcopy(model) if batches is not None and spec.bias_correction else None
    result = prune_transformer(model, heads_ratio=heads_ratio, mlp_ratio=ratio, drop_blocks=spec.drop_blocks,
                               example_inputs=keywords, round_to=widths.round_to, activations=activations)
    refitted = refit_narrowed_layers(original, model, batches) if original is not None else []
    before, after = result["before"], result["after"]
    notes = [f"structured_prune {line}" for line in result["skipped"]]
    if before["heads"] and after["heads"] != before["heads"]:
        removed = 1 - after["heads"] / before["heads"]
        if abs(removed - heads_ratio) > 0.05:
            notes.append(f"structured_prune removed {before['heads'] - after['heads']} of {before['heads']} "
                         f"attention heads ({removed:.2f}, asked {heads_ratio:g}): heads go in whole key/value groups "
                         f"({before['kv_heads']} here), so the share was rounded")
    if refitted:
        notes.append(f"structured_prune refitted {len(refitted)} layer(s) that lost inputs (attention output and "
                     "MLP down projections) by least squares on the calibration text")
    return {"ratio": ratio, "importance": spec.importance, "refitted_layers": refitted, "transformer": result,
            "pruned_layers": after["attention_units"],
            "skipped_layers": {}, "notes": notes}
