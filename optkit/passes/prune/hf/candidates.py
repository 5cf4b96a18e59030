"""Several plans scored in one pass over a language model's blocks: the validation perplexity each would give.

The model is not changed and never copied whole. Each block in turn goes to the compute device in fp32
(:mod:`.blockwise`); its statistics are taken once on the calibration text flowing through the unpruned
blocks; then, for every plan, a copy of that one block is cut and refitted as the real prune would cut it,
and that plan's validation hidden states are run through it. After the last block, the model's own head
(final norm, output embeddings) turns each plan's hidden states into next-token log-likelihoods.

Cost: one calibration pass plus, per plan, one pass of the validation tokens and one refit per block; the
number of validation tokens is chosen from a time budget measured on the first block (:func:`val_rows`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from optkit.core.progress import progress
from optkit.passes.prune.hf import blockwise
from optkit.passes.prune.hf.least_squares import refit_layer
from optkit.passes.prune.hf.structure import Block, find_block_lists, without_cache

__all__ = ["score_plans", "val_rows"]

#: Bytes of logits computed at once when scoring (batch x length x vocabulary x 4).
LOGIT_BYTES = 256 * 2**20
#: The fewest validation rows a comparison of plans is made on.
MIN_ROWS = 8


def val_rows(model: nn.Module, structure: Block, calibration: Sequence[dict[str, Any]], plans: int, rows: int,
             budget_s: float, device: torch.device) -> tuple[int | None, float]:
    """How many validation rows (of the calibration rows' length) scoring ``plans`` plans can use within
    ``budget_s`` seconds, and the estimated seconds at that count.

    The first block's fp32 forward is timed on one calibration batch; per block, the scoring runs the
    calibration rows twice (the forward and the Gram matrices cost about the same), and for each plan one refit
    and one forward per validation row. ``(None, estimate at MIN_ROWS)`` when even :data:`MIN_ROWS` rows do not
    fit; otherwise at most ``rows``.
    """
    first = calibration[0]
    batch = next(iter(first.values())).shape[0]
    blocks = blockwise.chained_blocks(model)
    captured = blockwise.capture_inputs(model, blocks, [first])
    trial = copy.deepcopy(structure)
    trial.module.to(device=device, dtype=torch.float32)  # timed as the sweep computes a block
    args, kwargs = next(iter(captured.on(device)))
    with torch.no_grad():
        trial.module(*args, **kwargs)  # warm up
        start = time.perf_counter()
        trial.module(*args, **kwargs)
        per_row = (time.perf_counter() - start) / batch
    widths = [mlp.width for mlp in structure.mlps]
    solve_s = _solve_seconds(max(widths), device) if widths else 0.0
    calibration_rows = sum(len(next(iter(b.values()))) for b in calibration)
    fixed = len(blocks) * (2 * calibration_rows * per_row + plans * solve_s * (len(widths) + 1))
    per_val_row = per_row * len(blocks) * plans

    def estimate(count: int) -> float:
        return fixed + count * per_val_row

    affordable = int((budget_s - fixed) / max(per_val_row, 1e-9))
    if affordable < MIN_ROWS:
        return None, estimate(MIN_ROWS)
    count = min(rows, affordable)
    return count, estimate(count)


def _solve_seconds(width: int, device: torch.device) -> float:
    """Seconds one refit's least-squares solve of ``width`` inputs takes, from a smaller one timed here."""
    size = min(width, 1024)
    gram = torch.eye(size, dtype=torch.float32, device=device) * 2 + 1  # the refit solves in fp32
    start = time.perf_counter()
    torch.cholesky_solve(gram[:, :64], torch.linalg.cholesky(gram))
    return (time.perf_counter() - start) * (width / size) ** 3


def score_plans(model: nn.Module, structure: Block, plans: Sequence[blockwise.Plan],
                calibration: Sequence[dict[str, Any]], val_inputs: dict[str, torch.Tensor], val_targets: torch.Tensor,
                *, importance: str = "l1", refit: bool = True, device: torch.device | None = None,
                stage: str = "structured_prune", ignore_index: int = -100) -> list[float]:
    """The validation perplexity of each plan, as if ``model`` were cut to it (with the refit); ``model`` is
    left exactly as it was.

    Args:
        model: a language model the block-by-block prune takes; ``structure`` is its first block, parsed.
        plans: plans the stock class describes.
        calibration: forward keywords of calibration text (statistics, refit).
        val_inputs: ``input_ids`` and ``attention_mask`` of the validation rows.
        val_targets: the next token at each position but the last (``rows x (length - 1)``), ``ignore_index``
            where there is none.
        importance, refit: as the prune itself will use them.
        device: where blocks are computed (``None``: where the model is).
        stage: the name progress lines are shown under.

    Returns:
        one perplexity per plan, in order.
    """
    device = device or blockwise.device_of(model)
    blocks = blockwise.chained_blocks(model)
    path = find_block_lists(model)[0][0]
    calib = blockwise.capture_inputs(model, blocks, calibration)
    batch = max(1, LOGIT_BYTES // (val_inputs["input_ids"].shape[1] * _vocab(model) * 4))
    rows = len(val_inputs["input_ids"])
    val_batches = [{k: v[i:i + batch] for k, v in val_inputs.items()} for i in range(0, rows, batch)]
    streams = [blockwise.capture_inputs(model, blocks, val_batches)] * len(plans)
    settings = [blockwise.changed_settings(model, plan, structure) for plan in plans]
    shown = progress(stage, f"blocks scored for {len(plans)} plans", len(blocks))
    for index, module in enumerate(blocks):
        block = blockwise.visit(module, f"{path}.{index}", calib, device, model.config, structure)
        try:
            stats = blockwise.statistics(block, calib, device, refit=refit, keep_outputs=True)
            # Every plan keeps other inputs: one Gram matrix per layer serves them all.
            grams = {name: gathered.gram() for name, gathered in stats.inputs.items()}
            originals = {layer.name: layer.module.weight.detach().clone() for layer in blockwise.narrowed(block)}
            saved_call, block.call = block.call, None
            for number, plan in enumerate(plans):
                trial = copy.deepcopy(block)
                kept = blockwise.cut(trial, plan, stats.norms if importance == "activation" else None)
                blockwise.adopt_settings(trial.module, settings[number])
                if refit:
                    for layer in blockwise.narrowed(trial):
                        if layer.name in grams:
                            refit_layer(layer, originals[layer.name], kept[id(layer)], grams[layer.name])
                streams[number] = blockwise.outputs(trial, streams[number], device)
                del trial
            block.call = saved_call
            calib = blockwise.Captured(stats.outputs)
        finally:
            blockwise.leave(block)
        shown.step()
    return [_perplexity(model, blocks, stream, val_batches, val_targets, ignore_index) for stream in streams]


def _vocab(model: nn.Module) -> int:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(getattr(model.config, "vocab_size", 1))


class _Replay(nn.Module):
    """Stands in for a block: hands on the hidden states it is given, or (the last one) those it holds."""

    def __init__(self, replaced: nn.Module) -> None:
        super().__init__()
        self.replaced = [replaced]  # a list, so it is not registered as a child
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        return self.hidden if self.hidden is not None else (args[0] if args else next(iter(kwargs.values())))


def _perplexity(model: nn.Module, blocks: nn.ModuleList, stream: blockwise.Captured,
                val_batches: list[dict[str, torch.Tensor]], targets: torch.Tensor, ignore_index: int) -> float:
    """Run the model's head on a plan's last hidden states (every block replaced by a stand-in that hands them on)."""
    dtype = next(model.parameters()).dtype
    stand_ins = [_Replay(block) for block in blocks]
    originals = list(blocks)
    nll, count, offset = 0.0, 0, 0
    try:
        for index, stand_in in enumerate(stand_ins):
            blocks[index] = stand_in
        for batch, (args, kwargs) in zip(val_batches, stream.calls, strict=True):
            hidden = args[0] if args else next(iter(kwargs.values()))
            stand_ins[-1].hidden = hidden.to(device=blockwise.device_of(model), dtype=dtype)
            with torch.no_grad():
                logits = model(**without_cache(model, batch)).logits
            rows = len(logits)
            wanted = targets[offset:offset + rows].to(logits.device)
            scored = wanted != ignore_index
            log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            picked = log_probs.gather(-1, wanted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            nll -= float(picked[scored].double().sum())
            count += int(scored.sum())
            offset += rows
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
    return math.exp(nll / max(count, 1))
