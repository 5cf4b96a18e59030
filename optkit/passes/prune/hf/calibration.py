"""Activation statistics on calibration data, for activation-aware importance.

A weight's importance is then ``|W| * ||x||`` (Wanda's criterion, applied to
whole heads and MLP channels): a channel that carries large activations on
real text counts for more than its weight norm alone says. The statistics are
the root mean square of each input channel of every linear-like module (an
``nn.Linear``, or the transposed ``Conv1D`` of GPT-2-style models) over every
token of the calibration batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from optkit.passes.prune.spec import PruneSpec

__all__ = ["calibration_text", "example_keywords", "input_norms", "run_with_inputs", "spread_blocks",
           "text_batches"]


def input_norms(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Root mean square of each input channel of every two-dimensional-weight module, over all tokens of ``batches``.

    Args:
        model: the model (run in eval mode, without gradients; its training mode is restored).
        batches: keyword arguments of its forward pass (``input_ids``, ``attention_mask``).

    Returns:
        module name -> tensor of its input width, for every module that ran; empty when no batch ran.
    """
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def accumulate(name: str, x: torch.Tensor) -> None:
        x = x.float()
        sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
        counts[name] = counts.get(name, 0) + len(x)

    names = [name for name, module in model.named_modules()
             if not isinstance(module, nn.Embedding) and isinstance(getattr(module, "weight", None), torch.Tensor)
             and module.weight.dim() == 2]
    run_with_inputs(model, names, batches, accumulate)
    return {name: (total / counts[name]).sqrt().cpu() for name, total in sums.items()}


def run_with_inputs(model: nn.Module, names: Iterable[str], batches: Iterable[dict[str, torch.Tensor]],
                    record: Callable[[str, torch.Tensor], None]) -> None:
    """Run ``model`` on ``batches`` (eval mode, no gradients; its mode is restored) and hand every floating-point
    input of the named modules to ``record(name, x)``, flattened to one row per token (``tokens × channels``)."""
    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                record(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        return hook

    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(hook_for(name)) for name in names]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def text_batches(model: nn.Module, spec: str, seq_len: int, batches: int, batch_size: int) -> list[dict[str, Any]]:
    """``batches × batch_size`` blocks of ``seq_len`` tokens evenly spaced across ``spec``'s train split, as forward
    keywords (the first ones of a split hold only its first files: measured on a model trained on other text, 64
    rows from across the split gave 1.11x validation perplexity at 0.8 of the parameters, its first 64 rows 1.19x).

    The text is tokenized by the model's own tokenizer, found beside its config (see
    :func:`optkit.analysis.evaluation.tokenizer_folders`).

    Raises:
        DataError: for a spec that is not text, or a model without a tokenizer folder.
    """
    ids, mask = spread_blocks(model, spec, "train", seq_len, batches * batch_size)
    return [{"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size]}
            for i in range(0, len(ids), batch_size)]


def spread_blocks(model: nn.Module, spec: str, split: str, seq_len: int, count: int) -> tuple[Any, Any]:
    """``count`` blocks of ``seq_len`` tokens evenly spaced across ``spec``'s ``split``, tokenized by the model's own
    tokenizer: token ids and attention mask (see :func:`optkit.data.text.token_blocks`, ``spread``)."""
    from optkit.analysis.evaluation import DataReaders

    config = getattr(model, "config", None)
    return DataReaders(model).token_blocks(spec, split, seq_len, count, vocab_size=getattr(config, "vocab_size", None),
                                           max_positions=getattr(config, "max_position_embeddings", None),
                                           spread=True)


def example_keywords(model: nn.Module, spec: PruneSpec) -> dict[str, Any]:
    """The model's example inputs as forward keywords (without ``use_cache``)."""
    from optkit.kinds import example_inputs

    inputs = example_inputs(model, spec.input_shape)
    keywords = dict(inputs.kwargs) or {getattr(model, "main_input_name", "input"): inputs.first()}
    keywords.pop("use_cache", None)
    return keywords


def calibration_text(model: nn.Module, spec: PruneSpec) -> list[dict[str, Any]] | None:
    """The transformer's calibration batches: ``calibration``, or ``calibration_batches`` batches of text blocks
    from ``data`` (a text spec), each as long as the example inputs; ``None`` without either."""
    from optkit.data.specs import is_text
    from optkit.passes.prune.hf.calibration import text_batches

    if spec.calibration is not None:
        return list(spec.calibration)
    if spec.data is None or not is_text(spec.data):
        return None
    return text_batches(model, spec.data, spec.input_shape[-1], spec.calibration_batches, spec.batch_size)
