"""Structured pruning to a measured latency target (``StructuredPrune(target_latency=...)``).

A per-layer latency table (:mod:`optkit.analysis.latency_table`) predicts how
long the conv/linear layers take at any channel counts. Starting from the
full model, channels are removed ``round_to`` at a time from the dependency
group that loses the least importance (group L1 magnitude, normalized per
group as torch-pruning's ``GroupMagnitudeImportance``) per predicted
millisecond saved, until the predicted latency is at most the target. The
result becomes per-group ratios (``layer_ratios``) pruned by the ordinary
:class:`~optkit.passes.prune.passes.StructuredPrune` machinery; the original
and the pruned model are exported to ONNX and timed in alternation, and the
predicted target is corrected by the measured/predicted ratio (or, once tries
lie on both sides of the target, interpolated between them) and retried (at
most :data:`MAX_RETRIES` times) until the measured fraction is within
:data:`LATENCY_TOLERANCE`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult

if TYPE_CHECKING:
    from torch import nn

    from optkit.analysis.latency_table import LatencyTable

LATENCY_TOLERANCE = 0.05
MAX_RETRIES = 2
AUTO_ROUND_TO = (4, 8, 16, 32)
#: A group keeps at least this fraction of its channels (and at least ``round_to``).
MIN_KEEP = 0.05


@dataclass
class Group:
    """One dependency group: its root's name (relative to the pruned module), width and what it shrinks.

    Attributes:
        pattern: the root's name for ``layer_ratios``.
        channels: the root's output channels.
        cumulative: importance lost when the ``k`` least important channels go (``cumulative[k]``).
        outs, ins: table layer names whose outputs / inputs this group shrinks.
    """

    pattern: str
    channels: int
    cumulative: list[float]
    outs: list[str]
    ins: list[str]


def search(settings: Pass, model: nn.Module) -> PassResult:
    """Prune a copy of ``model`` until its measured ONNX Runtime latency is ``settings.target_latency`` of the original.

    ``settings`` is the :class:`~optkit.passes.prune.passes.StructuredPrune` pass.

    Returns:
        the pruned copy, with details: ``target_latency``, ``predicted_fraction``,
        ``measured_fraction``, ``macs_fraction``, ``round_to`` (and ``round_to_scores``
        when it was ``auto``), ``lut`` (the table's cost), ``tries`` and the chosen
        prune's details.
    """
    from optkit.analysis.latency_table import build_table
    from optkit.analysis.metrics import count_macs

    shape = tuple(settings.input_shape or DEFAULT_INPUT_SHAPE)
    timed_shape = (settings.latency_batch, *shape[1:])
    threads = settings.latency_threads or os.cpu_count() or 1
    target = settings.target_latency
    table = build_table(model, shape, threads=threads, batch=settings.latency_batch)
    groups = _groups(settings, model)
    details: dict[str, Any] = {"target_latency": target, "lut": dict(table.cost)}
    if settings.round_to == "auto":
        scores = {r: _ms_per_mac(table, groups, _greedy(table, groups, target, r)) for r in AUTO_ROUND_TO}
        round_to = min(scores, key=scores.get)
        details["round_to_scores"] = {str(r): s for r, s in scores.items()}
    else:
        round_to = settings.round_to
    macs_before = count_macs(model, shape)
    tries: list[dict[str, float]] = []
    best = None
    aim = target
    with tempfile.TemporaryDirectory(prefix="optkit-latency-") as folder:
        original = _export(model, folder, "original", timed_shape)
        for attempt in range(MAX_RETRIES + 1):
            kept = _greedy(table, groups, aim, round_to)
            predicted = _predicted_fraction(table, groups, kept)
            candidate = copy.deepcopy(model)
            ratios = {g.pattern: (g.channels - kept[i]) / g.channels - 1e-9
                      for i, g in enumerate(groups) if kept[i] < g.channels}
            run = dataclasses.replace(settings, target_latency=None, ratio=0.0, layer_ratios=ratios or None,
                                      round_to=round_to, global_=False)
            prune_details = run.prune(candidate, 0.0)
            pruned = _export(candidate, folder, f"pruned{attempt}", timed_shape)
            measured = _measured_fraction(original, pruned, timed_shape, threads)
            tries.append({"aim": round(aim, 4), "predicted_fraction": round(predicted, 4),
                          "measured_fraction": round(measured, 4)})
            if best is None or abs(measured - target) < abs(best[0] - target):
                best = (measured, predicted, candidate, prune_details)
            if abs(measured - target) <= LATENCY_TOLERANCE:
                break
            aim = _next_aim([(t["predicted_fraction"], t["measured_fraction"]) for t in tries], target)
    measured, predicted, pruned_model, prune_details = best
    details.update(prune_details)
    details.update({"predicted_fraction": round(predicted, 4), "measured_fraction": round(measured, 4),
                    "macs_fraction": round(count_macs(pruned_model, shape) / macs_before, 4), "round_to": round_to,
                    "threads": threads, "batch": settings.latency_batch, "tries": tries})
    if abs(measured - target) > LATENCY_TOLERANCE:
        details.setdefault("notes", []).append(
            f"structured_prune: asked latency {target:g} of the original, measured {measured:.3f} "
            f"(closest of {len(tries)} tries)")
    return PassResult(pruned_model, details)


def _next_aim(points: list[tuple[float, float]], target: float) -> float:
    """The next predicted fraction to aim at, from the (predicted, measured) fractions of the tries so far.

    Between the closest tries measured below and above the target, interpolate linearly; without
    such a pair, scale the last prediction by target/measured.
    """
    below = max((p for p in points if p[1] < target), default=None, key=lambda p: p[1])
    above = min((p for p in points if p[1] > target), default=None, key=lambda p: p[1])
    if below and above and above[0] != below[0]:
        return below[0] + (above[0] - below[0]) * (target - below[1]) / (above[1] - below[1])
    predicted, measured = points[-1]
    return min(1.0, predicted * target / measured) if measured > 0 else predicted


def _groups(settings: Pass, model: nn.Module) -> list[Group]:
    """The dependency groups StructuredPrune would prune, with their importance and the layers they shrink."""
    import torch
    import torch_pruning as tp

    from optkit.passes.prune import engine

    root, inputs, submodule = settings._root_and_inputs(model)
    held, _ = engine.user_choices(root, settings.ignored_layers, None)
    options = engine.Options(tp.importance.GroupMagnitudeImportance(p=1), 0.0, False, 1, 1)
    plan = engine.build_plan(root, inputs, options, held, {}, submodule)
    prefix = f"{submodule}." if submodule else ""
    names = {m: n for n, m in root.named_modules()}
    graph = plan.pruner.DG
    groups = []
    with torch.no_grad():
        for group in graph.get_all_groups(ignored_layers=plan.pruner.ignored_layers,
                                          root_module_types=plan.pruner.root_module_types):
            scores = options.importance(group)
            if scores is None:
                continue
            ordered = sorted(float(s) for s in scores)
            cumulative = [0.0]
            for s in ordered:
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
            groups.append(Group(names[group[0][0].target.module], len(ordered), cumulative, outs, ins))
    return groups


def _widths(table: LatencyTable, groups: list[Group], kept: list[int]) -> dict[str, tuple[int, int]]:
    widths = {name: [e.in_channels, e.out_channels] for name, e in table.layers.items()}
    for g, k in zip(groups, kept):
        for name in g.outs:
            if name in widths:
                widths[name][1] = max(1, round(table.layers[name].out_channels * k / g.channels))
        for name in g.ins:
            if name in widths:
                widths[name][0] = max(1, round(table.layers[name].in_channels * k / g.channels))
    return {name: (w[0], w[1]) for name, w in widths.items()}


def _layers_ms(table: LatencyTable, names: list[str], widths: dict[str, tuple[int, int]]) -> float:
    from optkit.analysis.latency_table import layer_ms

    return sum(layer_ms(table.layers[n], *widths[n]) for n in set(names) if n in table.layers)


def _greedy(table: LatencyTable, groups: list[Group], target: float, round_to: int) -> list[int]:
    """Kept channels per group once the predicted fraction is at most ``target`` (or nothing more can go)."""
    from optkit.analysis.latency_table import predict

    kept = [g.channels for g in groups]
    full = predict(table)
    widths = _widths(table, groups, kept)
    total = full
    while total > target * full:
        best = None
        for i, g in enumerate(groups):
            step = (-(-kept[i] // round_to) - 1) * round_to
            if step < max(round_to, MIN_KEEP * g.channels):
                continue
            touched = g.outs + g.ins
            after = _widths(table, [g], [step])
            after = {n: (after[n][0] if n in g.ins else widths[n][0], after[n][1] if n in g.outs else widths[n][1])
                     for n in touched if n in widths}
            saved = _layers_ms(table, touched, widths) - _layers_ms(table, touched, {**widths, **after})
            lost = g.cumulative[g.channels - step] - g.cumulative[g.channels - kept[i]]
            score = lost / max(saved, 1e-9)
            if best is None or score < best[0]:
                best = (score, i, step, after, saved)
        if best is None:
            break
        _, i, step, after, saved = best
        kept[i] = step
        widths.update(after)
        total -= saved
    return kept


def _predicted_fraction(table: LatencyTable, groups: list[Group], kept: list[int]) -> float:
    from optkit.analysis.latency_table import predict

    return predict(table, _widths(table, groups, kept)) / predict(table)


def _ms_per_mac(table: LatencyTable, groups: list[Group], kept: list[int]) -> float:
    """Predicted milliseconds per remaining MAC of the conv/linear layers (lower is better)."""
    from optkit.analysis.latency_table import predict

    widths = _widths(table, groups, kept)
    macs = 0.0
    for name, e in table.layers.items():
        cin, cout = widths[name]
        macs += e.macs * (cout / e.out_channels) * (1.0 if e.depthwise else cin / e.in_channels)
    return predict(table, widths) / macs if macs else float("inf")


def _export(model: nn.Module, folder: str, name: str, shape: tuple[int, ...]) -> str:
    from optkit.export.onnx import export_onnx

    path = os.path.join(folder, f"{name}.onnx")
    export_onnx(model, path, shape, dynamic_batch=False)
    return path


def _measured_fraction(original: str, pruned: str, shape: tuple[int, ...], threads: int) -> float:
    from optkit.analysis.latency import interleaved_latency

    before, after = interleaved_latency([original, pruned], shape, threads=threads, repeats=30)
    return after.median_ms / before.median_ms
