"""The sensitivity target's handler: reach a MACs fraction with the least loss predicted by per-group curves.

:func:`optkit.passes.prune.targets.curves.analyze` measures (or reads from its cache)
what pruning each group alone costs. Starting from the full model, channels
go ``round_to`` at a time from the group whose next step adds the least
predicted loss per MAC saved (losses interpolated linearly between measured
ratios, never beyond the largest one measured; MACs from each conv/linear
layer's widths), until the predicted MACs reach the target. The resulting
per-group widths are pruned by :func:`~optkit.passes.prune.graph.channels.prune_to`; the achieved
MACs fraction corrects the aim (at most
:data:`~optkit.passes.prune.targets.allocation.MAX_CORRECTIONS` times) until it is
within ``target_tolerance``.

The curves are measured one group at a time, so they cannot see errors that
compound when many groups are cut far at once. The search therefore makes a
few allocations, from the curves alone to one that mostly spreads the cut
evenly (:data:`SPREADS`), scores each pruned copy whole on the analysis's
subset, and keeps the one with the least measured loss.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol

from optkit.core.contract import PassResult
from optkit.passes.prune.graph.channels import prune_to
from optkit.passes.prune.spec import PruneSpec
from optkit.passes.prune.graph.groups import ratios_for
from optkit.passes.prune.targets.allocation import MAX_CORRECTIONS, next_aim, shrink
from optkit.passes.prune.targets.configs import SensitivityTarget, handles, reach
from optkit.passes.prune.targets.ratio import target_notes

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.prune.targets.curves import Curve, Sensitivity


SPREADS = (0.0, 0.25, 0.5, 0.75)


@handles(SensitivityTarget)
def allocate_by_sensitivity(target: SensitivityTarget, spec: PruneSpec, model: nn.Module) -> PassResult:
    """Prune a copy of ``model`` to ``target.fraction`` of its MACs with per-group ratios chosen by sensitivity.

    The curves (``target.sensitivity``) predict each group's loss alone; pruned together, far, the
    groups' errors compound, and an allocation that concentrates the cut can do worse than its
    prediction. So one allocation is made per :data:`SPREADS` value (how much of the loss is a
    penalty on uneven cuts: 0 is the curves alone), each pruned copy is scored on the analysis's
    subset as pruned and recalibrated, and the one with the least measured loss is kept (each
    state's loss over its total among the candidates, as the points' are). An analysis made by
    hand, which cannot score models, gives the first candidate. Copies are pruned in one step, as
    the curves were measured.

    Returns:
        the pruned copy, with details: ``allocation``, ``target_fraction``, ``achieved_fraction``,
        ``predicted_loss`` (summed over groups, in the analysis's metric), ``layer_ratios``, ``tries``,
        ``spread`` and ``candidates`` (each allocation tried, with its measured scores),
        ``sensitivity`` (its cost and unmeasured groups) and the chosen prune's details.
    """
    from optkit.passes.prune.targets.latency_table import layer_specs

    sensitivity, goal = target.sensitivity, target.fraction
    specs = layer_specs(model, spec.input_shape)
    spreads = SPREADS if sensitivity.score_model is not None else SPREADS[:1]
    candidates: list[tuple] = []
    tries: list[dict[str, float]] = []
    for spread in spreads:
        best = None
        round_to = target.round_to
        while True:
            best = _corrected(model, spec, target, specs, round_to, tries, best, spread)
            if abs(best[0] - goal) <= target.tolerance or round_to == 1:
                break
            round_to = max(1, round_to // 2)
        if any(c[1][3] == best[3] for c in candidates):
            continue
        scored = sensitivity.score_model(best[1]) if len(spreads) > 1 else None
        candidates.append((spread, best, scored))
    measured = sensitivity.losses_among([c[2] for c in candidates]) if len(candidates) > 1 else [0.0]
    chosen = min(range(len(candidates)), key=lambda i: measured[i])
    spread, (achieved, pruned, details, ratios, predicted_loss, round_to), _ = candidates[chosen]
    details.update({"allocation": "sensitivity", "target": "macs", "target_fraction": goal,
                    "achieved_fraction": round(achieved, 4), "predicted_loss": round(predicted_loss, 6),
                    "metric": sensitivity.metric, "layer_ratios": ratios, "round_to": round_to, "spread": spread,
                    "candidates": [_candidate_summary(c, loss) for c, loss in zip(candidates, measured)],
                    "tries": tries, "sensitivity": {**sensitivity.cost, "unmeasured": sensitivity.unmeasured}})
    notes = details.setdefault("notes", [])
    if sensitivity.unmeasured:
        notes.append(f"structured_prune: sensitivity measured {len(sensitivity.curves) - len(sensitivity.unmeasured)}"
                     f" of {len(sensitivity.curves)} groups within its time budget; the rest are not pruned")
    notes.extend(target_notes(target, achieved, round_to, len(tries), "the measured ratios may not reach that far"))
    return PassResult(pruned, details)


class BuildsTarget(Protocol):
    """What :func:`search` takes: a :class:`~optkit.passes.prune.passes.StructuredPrune` (not imported: it imports
    this module to register the handler)."""

    def target(self, model: nn.Module, sensitivity: Sensitivity | None = None) -> Any: ...

    def spec(self) -> PruneSpec: ...


def search(prune: BuildsTarget, model: nn.Module, sensitivity: Sensitivity | None = None) -> PassResult:
    """Sensitivity allocation for a StructuredPrune with ``allocation="sensitivity"``, using ``sensitivity``.

    For ``optkit sensitivity``, which holds the pass and an analysis it made.

    Args:
        prune: the pass (``target_macs`` is the MACs fraction).
        model: the model; a pruned copy is returned.
        sensitivity: curves already measured for ``model`` (default: measured now on ``prune.data``).

    Returns:
        as :func:`allocate_by_sensitivity`.
    """
    return reach(prune.target(model, sensitivity), prune.spec(model), model)


def _candidate_summary(candidate: tuple, measured_loss: float) -> dict[str, Any]:
    spread, best, scored = candidate
    summary = {"spread": spread, "achieved_fraction": round(best[0], 4), "predicted_loss": round(best[4], 6)}
    if scored is not None:
        summary.update(measured_loss=round(measured_loss, 6), agreement=scored.agreement, mean_kl=scored.mean_kl,
                       as_pruned_agreement=scored.as_pruned_agreement)
    return summary


def _corrected(model: nn.Module, spec: PruneSpec, target: SensitivityTarget, specs: dict[str, dict[str, Any]],
               round_to: int, tries: list[dict[str, float]], best: tuple | None, spread: float) -> tuple:
    """Allocate at ``round_to``, prune a copy, correct the aim by the achieved MACs; the closest try so far."""
    from optkit.model.stats import count_macs

    sensitivity, goal = target.sensitivity, target.fraction
    aim = goal
    for _ in range(MAX_CORRECTIONS + 1):
        kept, predicted_loss = allocate(sensitivity, specs, aim, round_to, slack=target.tolerance, spread=spread)
        ratios = ratios_for(sensitivity.groups, kept)
        candidate = copy.deepcopy(model)
        details = prune_to(candidate, spec, spec.per_group(ratios, round_to, steps=1))
        achieved = count_macs(candidate, spec.input_shape) / sensitivity.macs
        tries.append({"spread": spread, "aim": round(aim, 4), "round_to": round_to,
                      "achieved_fraction": round(achieved, 4)})
        if best is None or abs(achieved - goal) < abs(best[0] - goal):
            best = (achieved, candidate, details, ratios, predicted_loss, round_to)
        if abs(achieved - goal) <= target.tolerance:
            break
        aim = next_aim([(t["aim"], t["achieved_fraction"]) for t in tries
                        if t["round_to"] == round_to and t["spread"] == spread], goal)
    return best


def allocate(sensitivity: Sensitivity, specs: dict[str, dict[str, Any]], target: float,
             round_to: int, slack: float = 0.0, spread: float = 0.0) -> tuple[list[int], float]:
    """Kept channels per group (in ``sensitivity.groups`` order) predicted to reach MACs ``target``.

    Args:
        sensitivity: the curves and the groups.
        specs: :func:`~optkit.passes.prune.targets.latency_table.layer_specs` of the model (conv/linear MACs and widths).
        target: the MACs fraction to reach.
        round_to: channels go this many at a time.
        slack: how far below ``target`` (a MACs fraction) the prediction may land (see
            :func:`~optkit.passes.prune.targets.allocation.shrink`).
        spread: share of the loss that is a penalty on uneven cuts, ``macs_share * removed**2`` per
            group (its marginal cost per MAC is the same for every group at the same fraction
            removed, so alone it gives a uniform cut); each part is divided by its total over the
            measured points.

    Returns:
        the kept counts and their summed predicted loss (the curves' part, in the metric's units).
    """
    full = {name: (spec["in"], spec["out"]) for name, spec in specs.items()}
    layer_macs = sum(spec["macs"] for spec in specs.values())
    other = sensitivity.macs - layer_macs

    def cost(name: str, cin: int, cout: int) -> float:
        spec = specs[name]
        return spec["macs"] * cout / spec["out"] * (1.0 if spec["depthwise"] else cin / spec["in"])

    curves = sensitivity.curves
    loss = [_loss_curve(sensitivity, c) for c in curves]
    points = [(c, p) for c in curves for p in c.points]
    curves_total = sum(sensitivity.loss(p) for _, p in points) or 1.0
    penalty_total = sum(c.macs_share * (1 - p.kept / c.channels) ** 2 for c, p in points) or 1.0

    def blended(i: int, k: int) -> float:
        removed = 1 - k / curves[i].channels
        if not spread:
            return loss[i](removed)
        return ((1 - spread) * loss[i](removed) / curves_total
                + spread * curves[i].macs_share * removed ** 2 / penalty_total)

    max_removed = [max((1 - p.kept / c.channels for p in c.points), default=0.0) for c in curves]
    kept = shrink(sensitivity.groups, full, cost, target * sensitivity.macs - other, round_to=round_to,
                  loss=blended, max_removed=max_removed, slack=slack * sensitivity.macs)
    return kept, sum(loss[i](1 - k / curves[i].channels) for i, k in enumerate(kept))


def _loss_curve(sensitivity: Sensitivity, curve: Curve):
    """Loss as a function of the fraction removed: piecewise linear through (0, 0) and the points, non-decreasing."""
    xs, ys = [0.0], [0.0]
    for point in sorted(curve.points, key=lambda p: p.kept, reverse=True):
        removed = 1 - point.kept / curve.channels
        if removed > xs[-1]:
            xs.append(removed)
            ys.append(max(ys[-1], sensitivity.loss(point)))

    def at(removed: float) -> float:
        for i in range(1, len(xs)):
            if removed <= xs[i]:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (removed - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[-1]

    return at
