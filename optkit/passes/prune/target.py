"""Find the structured pruning ratio that reaches a MACs or parameter target.

The fraction kept falls (not always strictly: channel rounding makes steps)
as the ratio grows, so the ratio is found by bracketing search, each try
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
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult

if TYPE_CHECKING:
    from torch import nn

MAX_RATIO = 0.95
MAX_TRIES = 12
#: A result further than this from its target is reported in one plain line.
REPORT_TOLERANCE = 0.02


def search(settings: Pass, model: nn.Module, *, refine_round_to: bool = True) -> PassResult:
    """Prune copies of ``model`` at searched ratios until the target is met.

    ``settings`` is the :class:`~optkit.passes.prune.passes.StructuredPrune` pass
    (this module does not import it: the pass imports this one).

    When ``round_to`` makes the target unreachable within ``target_tolerance``
    by one ratio for every group, per-group counts (each a multiple of
    ``round_to``, the fractions removed as even as the steps allow) are tried
    next (:func:`_even_fill`); only if those miss too is the search repeated
    with ``round_to`` halved, down to 1 (unless ``refine_round_to`` is false),
    and the closest result kept; the details say so. A result still further than :data:`REPORT_TOLERANCE` from
    the target gets a one-line note for the report.

    Returns:
        the best pruned copy, with details: ``target`` (``macs`` or
        ``params``), ``target_fraction``, ``achieved_fraction``, the chosen
        ``ratio`` (``None`` for per-group counts, given as ``layer_ratios``),
        the ``round_to`` used and every ``tries`` entry, plus the chosen run's
        details.
    """
    import dataclasses

    from optkit.analysis.metrics import count_macs, count_params

    shape = settings.input_shape or DEFAULT_INPUT_SHAPE
    kind, target = ("macs", settings.target_macs) if settings.target_macs is not None else ("params", settings.target_params)

    def measure(m: nn.Module) -> int:
        return count_macs(m, shape) if kind == "macs" else count_params(m)

    original = measure(model)
    tries: list[dict[str, float]] = []
    current = settings
    best = _bracket(current, model, target, lambda m: measure(m) / original, tries)
    if abs(best[0] - target) > settings.target_tolerance and current.round_to > 1:
        filled = _even_fill(current, model, kind, target, lambda m: measure(m) / original, tries)
        if filled is not None and abs(filled[0] - target) < abs(best[0] - target):
            best = filled
    while refine_round_to and abs(best[0] - target) > settings.target_tolerance and current.round_to > 1:
        current = dataclasses.replace(current, round_to=max(1, current.round_to // 2))
        finer = _bracket(current, model, target, lambda m: measure(m) / original, tries)
        if abs(finer[0] - target) < abs(best[0] - target):
            best = finer
    achieved, pruned, details, round_to = best
    details.update({"target": kind, "target_fraction": target, "achieved_fraction": round(achieved, 4),
                    "round_to": round_to, "tries": tries})
    details.setdefault("notes", []).extend(
        target_notes(settings, kind, target, achieved, round_to, len(tries), "see held and skipped layers"))
    return PassResult(pruned, details)


def target_notes(settings: Pass, kind: str, target: float, achieved: float, round_to: int, tries: int,
                 why: str) -> list[str]:
    """The report's lines for a target search: a refined ``round_to``, and a miss beyond :data:`REPORT_TOLERANCE`."""
    notes = []
    if round_to != settings.round_to:
        notes.append(f"structured_prune: round_to {settings.round_to} could not reach {kind} {target:g} within "
                     f"{settings.target_tolerance:g}; channel counts are multiples of {round_to} instead "
                     f"(achieved {achieved:.3f})")
    if abs(achieved - target) > REPORT_TOLERANCE:
        notes.append(f"structured_prune: asked {kind} {target:g} of the original, achieved {achieved:.3f} "
                     f"(closest of {tries} tries; {why})")
    return notes


def _bracket(settings: Pass, model: nn.Module, target: float, fraction, tries: list) -> tuple:
    """The bracketing search at ``settings.round_to``: ``(achieved, pruned copy, details, round_to)`` closest to target."""
    best = None
    low, high = (0.0, 1.0), (MAX_RATIO, (1 - MAX_RATIO) ** 2)
    for _ in range(MAX_TRIES):
        ratio = _next_ratio(low, high, target)
        candidate = copy.deepcopy(model)
        details = settings.prune(candidate, ratio)
        achieved = fraction(candidate)
        tries.append({"ratio": ratio, "round_to": settings.round_to, "achieved_fraction": round(achieved, 4)})
        if best is None or abs(achieved - target) < abs(best[0] - target):
            best = (achieved, candidate, details, settings.round_to)
        if abs(achieved - target) <= settings.target_tolerance:
            break
        if achieved > target:
            low = (ratio, achieved)
        else:
            high = (ratio, achieved)
    return best


def _even_fill(settings: Pass, model: nn.Module, kind: str, target: float, fraction, tries: list) -> tuple | None:
    """Per-group kept counts at ``settings.round_to`` that reach ``target``: ``(achieved, copy, details, round_to)``.

    The greedy of :func:`~optkit.passes.prune.allocation.shrink` removes ``round_to`` channels at a time
    from the group where that costs the least, the cost of removing a fraction ``r`` of a group being
    its share of the layers' MACs (or parameters) times ``r**2``: at equal fractions every group costs
    the same per MAC saved, so the cut stays as close to uniform as the steps allow. The aim is
    corrected by the fraction each try achieves (at most
    :data:`~optkit.passes.prune.allocation.MAX_CORRECTIONS` times). ``None`` when no group can shrink.
    """
    import dataclasses

    from optkit.passes.prune.latency_table import layer_specs
    from optkit.passes.prune.allocation import MAX_CORRECTIONS, next_aim, shrink
    from optkit.passes.prune.groups import prunable_groups, ratios_for

    shape = tuple(settings.input_shape or DEFAULT_INPUT_SHAPE)
    specs = layer_specs(model, shape)
    groups = prunable_groups(settings, model)
    if not groups:
        return None
    full = {name: (spec["in"], spec["out"]) for name, spec in specs.items()}
    sizes = {name: spec["macs"] if kind == "macs" else _weights(spec) for name, spec in specs.items()}

    def cost(name: str, cin: int, cout: int) -> float:
        spec = specs[name]
        return sizes[name] * cout / spec["out"] * (1.0 if spec["depthwise"] else cin / spec["in"])

    shares = [sum(sizes[n] for n in dict.fromkeys(g.outs + g.ins) if n in sizes) for g in groups]

    def loss(i: int, kept: int) -> float:
        return shares[i] * (1 - kept / groups[i].channels) ** 2

    layers_total = sum(sizes.values())
    run = dataclasses.replace(settings, ratio=0.0, target_macs=None, target_params=None, allocation="uniform")
    best = None
    aim = target
    for _ in range(MAX_CORRECTIONS + 1):
        kept = shrink(groups, full, cost, aim * layers_total, round_to=settings.round_to, loss=loss,
                      slack=settings.target_tolerance * layers_total)
        ratios = ratios_for(groups, kept)
        candidate = copy.deepcopy(model)
        details = dataclasses.replace(run, layer_ratios=ratios or None).prune(candidate, 0.0)
        achieved = fraction(candidate)
        tries.append({"aim": round(aim, 4), "round_to": settings.round_to, "per_group": True,
                      "achieved_fraction": round(achieved, 4)})
        if best is None or abs(achieved - target) < abs(best[0] - target):
            details.update(ratio=None, layer_ratios=ratios)
            best = (achieved, candidate, details, settings.round_to)
        if abs(achieved - target) <= settings.target_tolerance:
            break
        aim = next_aim([(t["aim"], t["achieved_fraction"]) for t in tries if t.get("per_group")], target)
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
