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
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult
from optkit.passes.prune.allocation import next_aim, shrink
from optkit.passes.prune.groups import Group, layer_widths, prunable_groups, ratios_for

if TYPE_CHECKING:
    from torch import nn

    from optkit.analysis.latency_table import LatencyTable

LATENCY_TOLERANCE = 0.05
MAX_RETRIES = 2
AUTO_ROUND_TO = (4, 8, 16, 32)


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
    groups = prunable_groups(settings, model)
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
            ratios = ratios_for(groups, kept)
            run = dataclasses.replace(settings, target_latency=None, ratio=0.0, layer_ratios=ratios or None,
                                      round_to=round_to, allocation="uniform")
            prune_details = run.prune(candidate, 0.0)
            pruned = _export(candidate, folder, f"pruned{attempt}", timed_shape)
            measured = _measured_fraction(original, pruned, timed_shape, threads)
            tries.append({"aim": round(aim, 4), "predicted_fraction": round(predicted, 4),
                          "measured_fraction": round(measured, 4)})
            if best is None or abs(measured - target) < abs(best[0] - target):
                best = (measured, predicted, candidate, prune_details)
            if abs(measured - target) <= LATENCY_TOLERANCE:
                break
            aim = next_aim([(t["predicted_fraction"], t["measured_fraction"]) for t in tries], target)
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


def _full(table: LatencyTable) -> dict[str, tuple[int, int]]:
    return {name: (e.in_channels, e.out_channels) for name, e in table.layers.items()}


def _greedy(table: LatencyTable, groups: list[Group], target: float, round_to: int) -> list[int]:
    """Kept channels per group once the predicted fraction is at most ``target`` (or nothing more can go)."""
    from optkit.analysis.latency_table import layer_ms, predict

    return shrink(groups, _full(table), lambda name, cin, cout: layer_ms(table.layers[name], cin, cout),
                  target * predict(table), round_to=round_to,
                  loss=lambda i, kept: groups[i].cumulative[groups[i].channels - kept])


def _predicted_fraction(table: LatencyTable, groups: list[Group], kept: list[int]) -> float:
    from optkit.analysis.latency_table import predict

    return predict(table, layer_widths(_full(table), groups, kept)) / predict(table)


def _ms_per_mac(table: LatencyTable, groups: list[Group], kept: list[int]) -> float:
    """Predicted milliseconds per remaining MAC of the conv/linear layers (lower is better)."""
    from optkit.analysis.latency_table import predict

    widths = layer_widths(_full(table), groups, kept)
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
