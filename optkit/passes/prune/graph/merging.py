"""Patch merging found by structure: neighbours stacked into channels, then one linear.

A channels-last module that folds ``k`` spatial neighbours into its channels
(``x.reshape(B, H/2, 2, W/2, 2, C).permute(...).flatten(3)``: ``4C`` wide,
neighbour-major) and projects them with one linear, with a norm before or
after, defeats torch-pruning's reshape index mapping. Such a module is found
by what it does in one forward pass: its input is ``C`` wide, its one linear
reads ``k * C`` (k >= 2) channels, and its other children are norms; and by
trying it: a copy with one input and one output channel pruned runs. It is
traced as one opaque node (:mod:`optkit.passes.prune.graph.opaque`) and its input
channels are removed in every neighbour's copy (columns ``j * C + i``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.graph.attention import capture_calls
from optkit.passes.prune.graph.opaque import select_linear, select_norm

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Merging:
    """A patch merging module, its linear, the norm before it (over ``k * C``) and the norm after it."""

    module: Any
    linear: Any
    repeats: int
    norm_in: Any = None
    norm_out: Any = None

    @property
    def width(self) -> int:
        return self.linear.in_features // self.repeats

    def prune_in(self, dropped: Sequence[int]) -> None:
        """Remove input channels ``dropped`` (from every neighbour's copy)."""
        import torch

        width, gone = self.width, {int(i) for i in dropped}
        device = self.linear.weight.device
        cols = torch.tensor([j * width + i for j in range(self.repeats) for i in range(width) if i not in gone],
                            device=device)
        select_linear(self.linear, torch.arange(self.linear.out_features, device=device), cols)
        if self.norm_in is not None:
            select_norm(self.norm_in, cols)
        self._write_back(width, width - len(gone))

    def prune_out(self, dropped: Sequence[int]) -> None:
        """Remove output channels ``dropped``."""
        import torch

        out, gone = self.linear.out_features, {int(i) for i in dropped}
        rows = torch.tensor([i for i in range(out) if i not in gone], device=self.linear.weight.device)
        select_linear(self.linear, rows, torch.arange(self.linear.in_features, device=rows.device))
        if self.norm_out is not None:
            select_norm(self.norm_out, rows)
        self._write_back(out, len(rows))

    def _write_back(self, old: int, new: int) -> None:
        for name, value in list(vars(self.module).items()):
            if type(value) is int and "dim" in name and value == old:
                setattr(self.module, name, new)


def find_merging(root: nn.Module, inputs: Any, skip: set) -> list[Merging]:
    """Patch merging modules of ``root`` (see the module docstring), every instance of their class.

    Args:
        root: the module to be pruned.
        inputs: its example inputs.
        skip: modules already handled otherwise.
    """
    from torch import nn

    candidates = [m for m in root.modules() if m not in skip
                  and sum(isinstance(c, nn.Linear) for c in m.children()) == 1
                  and all(isinstance(c, nn.Linear | nn.LayerNorm) or not any(True for _ in c.parameters())
                          for c in m.children())]
    calls = capture_calls(root, inputs, candidates) if candidates else {}
    units = {m: _unit(m, calls[m]) for m in candidates if m in calls}
    found = []
    for kind in {type(m) for m in candidates}:
        members = [m for m in root.modules() if type(m) is kind]
        merging = [units.get(m) for m in members]
        if all(unit is not None for unit in merging) and _probe(merging[0], calls[members[0]]["call"]):
            found.extend(merging)
    return found


def _unit(module: nn.Module, record: dict) -> Merging | None:
    import torch
    from torch import nn

    if "call" not in record:
        return None
    args, _, output = record["call"]
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 3 or not isinstance(output, torch.Tensor):
        return None
    width = args[0].shape[-1]
    order = record["children"]
    linear = next((c for c in order if isinstance(c, nn.Linear)), None)
    if linear is None or linear.in_features % width or linear.in_features // width < 2:
        return None
    if output.shape[-1] != linear.out_features:
        return None
    at = order.index(linear)
    before, after = order[:at], order[at + 1:]
    if len(before) > 1 or len(after) > 1:
        return None
    if before and before[0].normalized_shape != (linear.in_features,):
        return None
    if after and after[0].normalized_shape != (linear.out_features,):
        return None
    return Merging(module, linear, linear.in_features // width, before[0] if before else None,
                   after[0] if after else None)


def _probe(unit: Merging, call: tuple) -> bool:
    import torch

    args, kwargs, output = call
    trial = copy.deepcopy(unit)
    try:
        trial.prune_in([unit.width - 1])
        trial.prune_out([unit.linear.out_features - 1])
        with torch.no_grad():
            out = trial.module(args[0][..., :-1], *args[1:], **kwargs)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.shape == (*output.shape[:-1], output.shape[-1] - 1)


def pruner(units: Sequence[Merging]):
    """A torch-pruning pruning function for the classes of ``units`` (each instance looked up by identity)."""
    import torch_pruning as tp

    by_module = {id(unit.module): unit for unit in units}

    class MergingPruner(tp.pruner.BasePruningFunc):
        def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            by_module[id(layer)].prune_in(idxs)
            return layer

        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            by_module[id(layer)].prune_out(idxs)
            return layer

        def get_in_channels(self, layer: nn.Module) -> int:
            return by_module[id(layer)].width

        def get_out_channels(self, layer: nn.Module) -> int:
            return by_module[id(layer)].linear.out_features

    return MergingPruner()
