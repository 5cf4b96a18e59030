"""The ratio, MACs and parameter targets' handlers: prune at one ratio, or find the one that reaches a fraction.

A :class:`~optkit.passes.prune.targets.configs.RatioTarget` is one
:func:`~optkit.passes.prune.graph.channels.prune_to` call. For a
:class:`~optkit.passes.prune.targets.configs.MacsTarget` or ``ParamsTarget``: the
fraction kept falls (not always strictly: channel rounding makes steps) as
the ratio grows, so the ratio is found by bracketing search, each try
pruning a fresh deep copy of the model. When ``round_to`` steps over the
target (small layers move in coarse steps), the groups are cut by different
multiples of ``round_to``, as evenly as the steps allow, before the rounding
itself is made finer: channel counts off the CPU kernels' vector width run
slower, often slower than the unpruned model. Removing a fraction r of channels
keeps roughly (1 - r)^2 of a layer's MACs and params (inputs and outputs both
shrink), so each next ratio interpolates linearly in the square root of the
fraction between the bracket's ends, falling back to bisection when that
would not shrink the bracket. The copy whose achieved fraction is closest to
the target is returned; the original model is left unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from optkit.core.contract import PassResult
from optkit.passes.prune.graph.channels import prune_to
from optkit.passes.prune.spec import PruneSpec
from optkit.passes.prune.targets.configs import FractionTarget, MacsTarget, ParamsTarget, RatioTarget, handles

if TYPE_CHECKING:
    from torch import nn

MAX_RATIO = 0.95
MAX_TRIES = 12
#: A result further than this from its target is reported in one plain line.
REPORT_TOLERANCE = 0.02

#: ``(achieved fraction, pruned copy, its details, round_to)``: one try of a search.
Try = tuple[float, Any, dict[str, Any], int]


@handles(RatioTarget)
def prune_at_ratio(target: RatioTarget, spec: PruneSpec, model: nn.Module) -> PassResult:
    """Prune ``model`` in place, every group losing ``target.ratio`` of its channels.

    Returns:
        the model with :func:`~optkit.passes.prune.graph.channels.prune_to`'s details.
    """
    return PassResult(model, prune_to(model, spec, spec.uniform(target.ratio, target.round_to)))


@handles(MacsTarget, ParamsTarget)
def search(target: FractionTarget, spec: PruneSpec, model: nn.Module, *, refine_round_to: bool = True,
           structure: Any = None) -> PassResult:
    """Prune copies of ``model`` at searched ratios until ``target``'s MACs or parameter fraction is met.

    When ``round_to`` makes the target unreachable within its tolerance
    by one ratio for every group, per-group counts (each a multiple of
    ``round_to``, the fractions removed as even as the steps allow) are tried
    next (:func:`_even_fill`); only if those miss too is the search repeated
    with ``round_to`` halved, down to 1 (unless ``refine_round_to`` is false),
    and the closest result kept; the details say so. A result still further than :data:`REPORT_TOLERANCE` from
    the target gets a one-line note for the report. ``structure``: a transformer's first block, already parsed
    (:func:`~optkit.passes.prune.hf.entry.first_block`) by a caller that has it.

    Returns:
        the best pruned copy, with details: ``target`` (``macs`` or
        ``params``), ``target_fraction``, ``achieved_fraction``, the chosen
        ``ratio`` (``None`` for per-group counts, given as ``layer_ratios``),
        the ``round_to`` used and every ``tries`` entry, plus the chosen run's
        details.
    """
    from optkit.model.stats import count_macs, count_params

    kind, goal = target.measured, target.fraction

    def measure(m: nn.Module) -> int:
        return count_macs(m, spec.input_shape) if kind == "macs" else count_params(m)

    original = measure(model)

    def fraction(m: nn.Module) -> float:
        return measure(m) / original

    tries: list[dict[str, Any]] = []
    round_to = target.round_to
    if _is_transformer(spec, model):
        return _transformer_search(target, spec, model, fraction, tries, structure)
    best = _bracket(spec, model, target, round_to, fraction, tries)
    if abs(best[0] - goal) > target.tolerance and round_to > 1:
        filled = _even_fill(spec, model, target, round_to, fraction, tries)
        if filled is not None and abs(filled[0] - goal) < abs(best[0] - goal):
            best = filled
    while refine_round_to and abs(best[0] - goal) > target.tolerance and round_to > 1:
        round_to = max(1, round_to // 2)
        finer = _bracket(spec, model, target, round_to, fraction, tries)
        if abs(finer[0] - goal) < abs(best[0] - goal):
            best = finer
    achieved, pruned, details, chosen_round_to = best
    details.update({"target": kind, "target_fraction": goal, "achieved_fraction": round(achieved, 4),
                    "round_to": chosen_round_to, "tries": tries})
    details.setdefault("notes", []).extend(
        target_notes(target, achieved, chosen_round_to, len(tries), "see held and skipped layers"))
    return PassResult(pruned, details)


def _transformer_search(target: FractionTarget, spec: PruneSpec, model: nn.Module,
                        fraction: Callable[[nn.Module], float], tries: list, structure: Any = None) -> PassResult:
    """A transformer is cut uniformly (whole heads, one MLP width for every block), so only the ratio is searched.

    Where the block-by-block prune takes the model, each ratio's size is read from the stock class built on
    the meta device from the config that ratio gives (nothing is pruned, nothing copied), and the found ratio
    is then pruned once, in place. Otherwise copies are pruned by weight norm alone (the sizes do not depend on
    the ranking or the refit), and the found ratio is pruned once with the pass's own importance and calibration.
    """
    import dataclasses

    from optkit.passes.prune.hf.calibration import example_keywords
    from optkit.passes.prune.hf.entry import first_block, prune_planned

    if structure is None and not spec.drop_blocks:
        structure = first_block(model, example_keywords(model, spec))
    if structure is not None:
        plan, round_to = _planned_uniform(target, model, structure, tries)
        pruned = model
        details = prune_planned(model, spec, plan, structure)
    else:
        light = dataclasses.replace(spec, importance="l1", bias_correction=False, calibration=None, data=None)
        _, _, _, round_to = _bracket(light, model, target, target.round_to, fraction, tries)
        ratio = min(tries, key=lambda t: abs(t["achieved_fraction"] - target.fraction))["ratio"]
        pruned = copy.deepcopy(model)
        details = prune_to(pruned, spec, spec.uniform(ratio, round_to))
    achieved = fraction(pruned)
    details.update({"target": target.measured, "target_fraction": target.fraction,
                    "achieved_fraction": round(achieved, 4), "round_to": round_to, "tries": tries})
    details.setdefault("notes", []).extend(
        target_notes(target, achieved, round_to, len(tries), "heads go whole and every block keeps the same widths"))
    return PassResult(pruned, details)


def uniform_heads(target: FractionTarget, model: nn.Module, structure: Any) -> tuple[int, int] | None:
    """``(key/value groups, query heads per group)`` that the uniform cut keeps to meet ``target``, sized on the
    meta device; ``None`` when no uniform cut is one the stock class describes."""
    try:
        plan, _ = _planned_uniform(target, model, structure, [])
    except ValueError:
        return None
    return plan.kv_keep, plan.q_keep


def _planned_uniform(target: FractionTarget, model: nn.Module, structure: Any, tries: list) -> tuple[Any, int]:
    """The uniform plan (one share for heads and MLP channels) that comes closest to ``target``, sizes read from
    the stock class on the meta device; when head counts move in steps too coarse to land within the tolerance,
    the MLP width alone is fitted to the target for the closest plan's heads."""
    from optkit.passes.prune.hf.blockwise import fit_mlp, full_plan, planned_size, uniform_plan

    original = planned_size(model, full_plan(structure), structure, target.measured)
    sizes: dict[Any, tuple[Any, float]] = {}

    def planned(ratio: float, round_to: int) -> tuple[Any, float]:
        plan, _ = uniform_plan(model, structure, ratio, ratio, round_to)
        if plan is None:
            return None, 1.0
        key = (plan.kv_keep, plan.q_keep, tuple(sorted(plan.mlp_keep.items())))
        if key not in sizes:
            sizes[key] = plan, planned_size(model, plan, structure, target.measured) / original
        return sizes[key]

    round_to = target.round_to
    low, high = (0.0, 1.0), (MAX_RATIO, planned(MAX_RATIO, round_to)[1])
    best = None
    for _ in range(MAX_TRIES):
        ratio = _next_ratio(low, high, target.fraction)
        plan, achieved = planned(ratio, round_to)
        tries.append({"ratio": ratio, "round_to": round_to, "planned_fraction": round(achieved, 4),
                      "achieved_fraction": round(achieved, 4)})
        if plan is not None and (best is None or abs(achieved - target.fraction) < abs(best[1] - target.fraction)):
            best = (plan, achieved)
        if abs(achieved - target.fraction) <= target.tolerance:
            break
        if achieved > target.fraction:
            low = (ratio, achieved)
        else:
            high = (ratio, achieved)
    if best is None:
        raise ValueError("no uniform cut of heads and MLP channels is one the stock class describes")
    chosen = round_to
    while abs(best[1] - target.fraction) > target.tolerance:
        fitted = fit_mlp(model, structure, best[0].kv_keep, best[0].q_keep, target.fraction, target.measured,
                         round_to)
        if fitted is not None and abs(fitted[1] - target.fraction) < abs(best[1] - target.fraction):
            best, chosen = fitted, round_to
            tries.append({"heads": fitted[0].heads(), "round_to": round_to, "planned_fraction": round(fitted[1], 4),
                          "achieved_fraction": round(fitted[1], 4), "mlp_fitted": True})
        if round_to == 1:
            break
        round_to = max(1, round_to // 2)
    return best[0], chosen


def _is_transformer(spec: PruneSpec, model: nn.Module) -> bool:
    from optkit.passes.prune.hf import describes_transformer

    return spec.submodule is None and describes_transformer(model)


def target_notes(target: FractionTarget, achieved: float, round_to: int, tries: int, why: str) -> list[str]:
    """The report's lines for a target search: a refined ``round_to``, and a miss beyond :data:`REPORT_TOLERANCE`."""
    notes = []
    kind, goal = target.measured, target.fraction
    if round_to != target.round_to:
        notes.append(f"structured_prune: round_to {target.round_to} could not reach {kind} {goal:g} within "
                     f"{target.tolerance:g}; channel counts are multiples of {round_to} instead "
                     f"(achieved {achieved:.3f})")
    if abs(achieved - goal) > REPORT_TOLERANCE:
        notes.append(f"structured_prune: asked {kind} {goal:g} of the original, achieved {achieved:.3f} "
                     f"(closest of {tries} tries; {why})")
    return notes


def _bracket(spec: PruneSpec, model: nn.Module, target: FractionTarget, round_to: int,
             fraction: Callable[[nn.Module], float], tries: list) -> Try:
    """The bracketing search at ``round_to``: the try closest to the target."""
    goal = target.fraction
    best = None
    low, high = (0.0, 1.0), (MAX_RATIO, (1 - MAX_RATIO) ** 2)
    for _ in range(MAX_TRIES):
        ratio = _next_ratio(low, high, goal)
        candidate = copy.deepcopy(model)
        details = prune_to(candidate, spec, spec.uniform(ratio, round_to))
        achieved = fraction(candidate)
        tries.append({"ratio": ratio, "round_to": round_to, "achieved_fraction": round(achieved, 4)})
        if best is None or abs(achieved - goal) < abs(best[0] - goal):
            best = (achieved, candidate, details, round_to)
        if abs(achieved - goal) <= target.tolerance:
            break
        if achieved > goal:
            low = (ratio, achieved)
        else:
            high = (ratio, achieved)
    return best


def _even_fill(spec: PruneSpec, model: nn.Module, target: FractionTarget, round_to: int,
               fraction: Callable[[nn.Module], float], tries: list) -> Try | None:
    """Per-group kept counts, multiples of ``round_to``, that reach the target: the closest try.

    The greedy of :func:`~optkit.passes.prune.targets.allocation.shrink` removes ``round_to`` channels at a time
    from the group where that costs the least, the cost of removing a fraction ``r`` of a group being
    its share of the layers' MACs (or parameters) times ``r**2``: at equal fractions every group costs
    the same per MAC saved, so the cut stays as close to uniform as the steps allow. The aim is
    corrected by the fraction each try achieves (at most
    :data:`~optkit.passes.prune.targets.allocation.MAX_CORRECTIONS` times). ``None`` when no group can shrink.
    """
    from optkit.passes.prune.graph.groups import prunable_groups, ratios_for
    from optkit.passes.prune.targets.allocation import MAX_CORRECTIONS, next_aim, shrink
    from optkit.passes.prune.targets.latency_table import layer_specs

    goal = target.fraction
    specs = layer_specs(model, spec.input_shape)
    groups = prunable_groups(spec, model)
    if not groups:
        return None
    full = {name: (layer["in"], layer["out"]) for name, layer in specs.items()}
    sizes = {name: layer["macs"] if target.measured == "macs" else _weights(layer) for name, layer in specs.items()}

    def cost(name: str, cin: int, cout: int) -> float:
        layer = specs[name]
        return sizes[name] * cout / layer["out"] * (1.0 if layer["depthwise"] else cin / layer["in"])

    shares = [sum(sizes[n] for n in dict.fromkeys(g.outs + g.ins) if n in sizes) for g in groups]

    def loss(i: int, kept: int) -> float:
        return shares[i] * (1 - kept / groups[i].channels) ** 2

    layers_total = sum(sizes.values())
    best = None
    aim = goal
    for _ in range(MAX_CORRECTIONS + 1):
        kept = shrink(groups, full, cost, aim * layers_total, round_to=round_to, loss=loss,
                      slack=target.tolerance * layers_total)
        ratios = ratios_for(groups, kept)
        candidate = copy.deepcopy(model)
        details = prune_to(candidate, spec, spec.per_group(ratios, round_to))
        achieved = fraction(candidate)
        tries.append({"aim": round(aim, 4), "round_to": round_to, "per_group": True,
                      "achieved_fraction": round(achieved, 4)})
        if best is None or abs(achieved - goal) < abs(best[0] - goal):
            details.update(ratio=None, layer_ratios=ratios)
            best = (achieved, candidate, details, round_to)
        if abs(achieved - goal) <= target.tolerance:
            break
        aim = next_aim([(t["aim"], t["achieved_fraction"]) for t in tries if t.get("per_group")], goal)
    return best


def _weights(spec: dict[str, Any]) -> int:
    """A conv/linear layer's weight count from its layer spec."""
    count = spec["out"] * (spec["in"] // spec.get("groups", 1))
    for k in spec.get("kernel", ()):
        count *= k
    return count


def _next_ratio(low: tuple[float, float], high: tuple[float, float], target: float) -> float:
    """Interpolate (ratio, fraction) bracket ends linearly in sqrt(fraction); bisect if that hugs an end."""
    (r0, f0), (r1, f1) = low, high
    g0, g1, gt = f0 ** 0.5, f1 ** 0.5, target ** 0.5
    ratio = r0 + (r1 - r0) * (g0 - gt) / (g0 - g1) if g0 != g1 else (r0 + r1) / 2
    margin = (r1 - r0) / 10
    if not r0 + margin <= ratio <= r1 - margin:
        ratio = (r0 + r1) / 2
    return round(ratio, 4)
