"""Compensation without training: layers that lost input channels are refitted to their old outputs.

When heads or MLP channels go, the layer that read them (the attention output
projection, the MLP down projection) loses inputs. Its remaining weights are
updated by least squares on calibration data so that it reproduces, as well as
the kept inputs can, what it computed from all of them:
``W' = argmin ||X_K W'^T - X W^T||``, solved from the inputs' Gram matrix
``G = X^T X`` as ``G[K, K] W'^T = G[K, :] W^T`` (with a small damping). This is
the data-driven counterpart of the vision path's BatchNorm bias correction.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from optkit.passes.prune.hf.least_squares import DAMPING

__all__ = ["DAMPING", "refit_narrowed_layers"]


def refit_narrowed_layers(original: nn.Module, pruned: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> list[str]:
    """Refit every layer of ``pruned`` whose input channels are a subset of ``original``'s, output unchanged.

    Args:
        original: the model before pruning (run on ``batches``; unchanged).
        pruned: the pruned model; its narrowed layers' weights are replaced in place.
        batches: keyword arguments of the forward pass (calibration text).

    Returns:
        the names of the layers refitted.
    """
    narrowed = _narrowed_layers(original, pruned)
    if not narrowed:
        return []
    grams = _input_grams(original, narrowed, batches)
    refitted = []
    for name, (before, after, axis) in narrowed.items():
        width = before.weight.shape[axis]
        if name not in grams or len(grams[name]) != width or (
                not isinstance(before, nn.Linear) and before.weight.shape[1 - axis] == width):
            continue  # the shrunk axis is not (unambiguously) the layer's input
        weight = before.weight.detach().float()
        weight = weight if axis == 1 else weight.t()  # one row per output, one column per input
        kept = _kept_inputs(weight, (after.weight.detach().float() if axis == 1 else after.weight.detach().float().t()))
        if kept is None:
            continue
        gram = grams[name].double()
        block = gram[kept][:, kept]
        block += torch.eye(len(kept), dtype=block.dtype) * DAMPING * block.diagonal().mean().clamp_min(1e-12)
        solved = torch.linalg.solve(block, gram[kept] @ weight.double().t()).t().to(after.weight.dtype)
        with torch.no_grad():
            after.weight.copy_(solved if axis == 1 else solved.t())
        refitted.append(name)
    return refitted


def _narrowed_layers(original: nn.Module, pruned: nn.Module) -> dict[str, tuple[nn.Module, nn.Module, int]]:
    """name -> (module before, module after, input axis of the weight) for layers that only lost inputs."""
    before = dict(original.named_modules())
    found = {}
    for name, module in pruned.named_modules():
        old = before.get(name)
        weight, old_weight = getattr(module, "weight", None), getattr(old, "weight", None)
        if (isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor)
                or not isinstance(old_weight, torch.Tensor) or weight.dim() != 2 or old_weight.dim() != 2):
            continue
        shrunk = [axis for axis in (0, 1) if weight.shape[axis] < old_weight.shape[axis]]
        kept = [axis for axis in (0, 1) if weight.shape[axis] == old_weight.shape[axis]]
        # An nn.Linear reads axis 1 of its weight; a transposed layer (Conv1D) is told apart by its input width.
        if len(shrunk) == 1 and len(kept) == 1 and (shrunk[0] == 1 or not isinstance(module, nn.Linear)):
            found[name] = (old, module, shrunk[0])
    return found


def _input_grams(model: nn.Module, layers: dict, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from optkit.passes.prune.hf.calibration import run_with_inputs

    grams: dict[str, torch.Tensor] = {}

    def accumulate(name: str, x: torch.Tensor) -> None:
        x = x.double()
        grams[name] = grams.get(name, 0) + x.t() @ x

    run_with_inputs(model, layers, batches, accumulate)
    return grams


def _kept_inputs(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None:
    """Which input columns of ``before`` (out × in) the narrower ``after`` kept, in its order; ``None`` when its
    columns are not copies of ``before``'s (the layer changed otherwise)."""
    index = {column.numpy().tobytes(): i for i, column in enumerate(before.t().contiguous())}
    kept = [index.get(column.numpy().tobytes()) for column in after.t().contiguous()]
    return None if any(i is None for i in kept) else torch.tensor(kept)
