"""The dependency groups a structured prune shrinks, and the layer widths a choice of channel counts gives.

Allocators (the latency target, sensitivity allocation) choose how many
channels each group keeps; these helpers describe the groups, turn kept counts
into the conv/linear widths they imply, and into the ``layer_ratios`` that make
:class:`~optkit.passes.prune.passes.StructuredPrune` keep exactly those counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optkit.core.contract import Pass

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Group:
    """One dependency group: its root's name (relative to the pruned module), width and what it shrinks.

    Attributes:
        pattern: the root's name, the key for ``layer_ratios``.
        channels: the root's output channels.
        cumulative: importance lost when the ``k`` least important channels go (``cumulative[k]``).
        outs, ins: full names of the conv/linear layers whose outputs / inputs this group shrinks.
    """

    pattern: str
    channels: int
    cumulative: list[float]
    outs: list[str]
    ins: list[str]


def prunable_groups(settings: Pass, model: nn.Module) -> list[Group]:
    """The dependency groups ``settings`` (a StructuredPrune pass) would prune, with group-L1 importance.

    Importance is torch-pruning's ``GroupMagnitudeImportance(p=1)`` (normalized per group). The model is
    traced, not changed.
    """
    import torch
    import torch_pruning as tp

    from optkit.passes.prune.graph import pruner as engine
    from optkit.passes.prune.graph.tp_fixes import converging_groups

    root, inputs, submodule = settings._root_and_inputs(model)
    held, _ = engine.user_choices(root, settings.ignored_layers, None)
    options = engine.Options(tp.importance.GroupMagnitudeImportance(p=1), 0.0, False, 1, 1)
    plan = engine.build_plan(root, inputs, options, held, {}, submodule)
    prefix = f"{submodule}." if submodule else ""
    names = {m: n for n, m in root.named_modules()}
    graph = plan.pruner.DG
    groups = []
    with torch.no_grad(), converging_groups():
        for group in graph.get_all_groups(ignored_layers=plan.pruner.ignored_layers,
                                          root_module_types=plan.pruner.root_module_types):
            try:
                scores = options.importance(group)
            except IndexError:  # torch-pruning cannot map this group's indices (q/k through a reshape): not listed
                continue
            if scores is None:
                continue
            cumulative = [0.0]
            for s in sorted(float(s) for s in scores):
                cumulative.append(cumulative[-1] + s)
            outs, ins = [], []
            for dep, _ in group:
                name = names.get(dep.target.module)
                if name is None or not isinstance(dep.target.module, tuple(engine.root_types())):
                    continue
                if graph.is_out_channel_pruning_fn(dep.handler):
                    outs.append(prefix + name)
                elif graph.is_in_channel_pruning_fn(dep.handler):
                    ins.append(prefix + name)
            groups.append(Group(names[group[0][0].target.module], len(cumulative) - 1, cumulative, outs, ins))
    return groups


def layer_widths(full: Mapping[str, tuple[int, int]], groups: Sequence[Group],
                 kept: Sequence[int]) -> dict[str, tuple[int, int]]:
    """The (in, out) channels of each layer in ``full`` once group ``i`` keeps ``kept[i]`` channels.

    A layer a group narrows scales with the fraction the group keeps (a layer may
    hold several copies of a group's channels, as after a concatenation).
    """
    widths = {name: [cin, cout] for name, (cin, cout) in full.items()}
    for g, k in zip(groups, kept):
        for name in g.outs:
            if name in widths:
                widths[name][1] = max(1, round(full[name][1] * k / g.channels))
        for name in g.ins:
            if name in widths:
                widths[name][0] = max(1, round(full[name][0] * k / g.channels))
    return {name: (w[0], w[1]) for name, w in widths.items()}


def ratios_for(groups: Sequence[Group], kept: Sequence[int]) -> dict[str, float]:
    """``layer_ratios`` that make StructuredPrune keep exactly ``kept[i]`` channels of group ``i``.

    Groups kept whole are left out. The ratio sits just below ``removed / channels`` so that
    torch-pruning's rounding of ``ratio * channels`` cannot remove one channel more.
    """
    return {g.pattern: round((g.channels - k) / g.channels - 1e-9, 12)
            for g, k in zip(groups, kept) if k < g.channels}
