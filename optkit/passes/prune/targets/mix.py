"""A transformer's parameter or MACs target, with the cut split between heads and MLP channels by measurement.

Removing the same share of attention heads and of MLP channels (the uniform
path) is one way to reach a target; a language model often keeps more when
the cut falls mostly on one of them. :class:`~optkit.passes.prune.targets.configs.MixTarget`
tries each head share the structure allows (whole heads, the same number
from every key/value group: at most :data:`HEAD_SHARES` of them), finds for
each the MLP share that reaches the target (parameters and MACs fall
linearly with the MLP width, so two trial prunes give it), prunes a copy at
that mix with the pass's importance and refit, and scores it on
:data:`VAL_BLOCKS` samples of the data's ``val`` split (perplexity on text, rows
evenly spaced across the split; an image transformer's top-1 error on its first
images).
The mix with the lowest perplexity is kept. Widths stay uniform across
blocks, so the stock class still describes the result.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from optkit.core.contract import PassResult
from optkit.passes.prune.graph.channels import prune_to
from optkit.passes.prune.spec import PruneSpec
from optkit.passes.prune.targets.configs import MixTarget, handles

if TYPE_CHECKING:
    from torch import nn

#: Head shares tried (before rounding to whole heads): none, then up to half of them.
HEAD_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5)
#: Validation blocks each candidate is scored on.
VAL_BLOCKS = 64
#: The MLP share is capped here: a block keeps at least a few channels.
MAX_MLP_SHARE = 0.9
#: Seconds the block-by-block mix search may spend scoring its plans (it chooses how many validation rows).
SCORE_BUDGET_S = 60.0


@handles(MixTarget)
def search(target: MixTarget, spec: PruneSpec, model: nn.Module) -> PassResult:
    """Prune copies of ``model`` at each head share with the MLP share that meets ``target``; keep the best scored.

    Returns:
        the kept copy, with details: ``allocation`` (``mix``), ``target``, ``target_fraction``,
        ``achieved_fraction``, ``heads_ratio`` and ``ratio`` (the MLP share) of the kept mix,
        ``val_measure`` and ``candidates`` (each mix's heads, MLP width, fraction and ``val_loss``:
        perplexity on text, top-1 error on images).
    """
    from optkit.analysis.evaluation import EvalSettings, load_eval_set, score, torch_logits
    from optkit.data.specs import is_text
    from optkit.model.stats import count_macs, count_params
    from optkit.passes.prune.hf.calibration import example_keywords
    from optkit.passes.prune.hf.entry import first_block

    def measure(m: nn.Module) -> int:
        return count_macs(m, spec.input_shape) if target.measured == "macs" else count_params(m)

    original = measure(model)
    structure = first_block(model, example_keywords(model, spec)) if is_text(spec.data) and not spec.drop_blocks else None
    if structure is not None:
        return _search_blockwise(target, spec, model, structure, measure, original)
    val = load_eval_set(EvalSettings(data=spec.data, samples=VAL_BLOCKS), model, spec.input_shape, split="val")
    light = dataclasses.replace(spec, importance="l1", bias_correction=False, calibration=None, data=None)

    def pruned(heads: float, mlp: float, how: PruneSpec) -> tuple[Any, dict[str, Any]]:
        widths = dataclasses.replace(how.uniform(mlp, target.round_to), heads_ratio=heads)
        candidate = copy.deepcopy(model)
        return candidate, prune_to(candidate, how, widths)

    candidates: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    best: tuple[float, Any, dict[str, Any]] | None = None
    for heads in HEAD_SHARES:
        # Two cheap prunes (weight norm, no refit) give the fraction at MLP shares 0 and 0.5; it is linear between.
        at_zero, _ = pruned(heads, 0.0, light)
        at_half, _ = pruned(heads, 0.5, light)
        kept_zero, kept_half = measure(at_zero) / original, measure(at_half) / original
        if kept_zero <= target.fraction or kept_zero == kept_half:
            mlp = 0.0
        else:
            mlp = 0.5 * (kept_zero - target.fraction) / (kept_zero - kept_half)
        if mlp > MAX_MLP_SHARE:
            continue
        candidate, details = pruned(heads, mlp, spec)
        key = (_heads(candidate), _intermediate(candidate))
        if key in seen:
            continue
        seen.add(key)
        achieved = measure(candidate) / original
        perplexity = _loss(score(torch_logits(candidate, val), val))
        candidates.append({"heads": key[0], "intermediate": key[1], "heads_ratio": heads, "mlp_ratio": round(mlp, 4),
                           "achieved_fraction": round(achieved, 4), "val_loss": round(perplexity, 4)})
        if abs(achieved - target.fraction) <= max(target.tolerance, 0.02) and (best is None or perplexity < best[0]):
            best = (perplexity, candidate, {**details, "heads_ratio": heads, "ratio": mlp, "achieved": achieved})
    if best is None:
        raise ValueError(f"no mix of heads and MLP channels reaches {target.measured} {target.fraction:g} within "
                         f"{max(target.tolerance, 0.02):g} (tried {len(candidates)}); use allocation uniform")
    perplexity, kept, details = best
    measure = "perplexity" if is_text(spec.data) else "top-1 error"
    achieved = details.pop("achieved")
    details.update({"allocation": "mix", "target": target.measured, "target_fraction": target.fraction,
                    "achieved_fraction": round(achieved, 4), "val_measure": measure, "candidates": candidates})
    details.setdefault("notes", []).append(
        f"structured_prune kept {_heads(kept)} heads and {_intermediate(kept)} MLP channels per "
        f"block ({target.measured} {achieved:.3f}): the lowest validation {measure} ({perplexity:.3f}) of "
        f"{len(candidates)} mixes of heads and MLP channels")
    return PassResult(kept, details)


def _loss(scores: dict[str, Any]) -> float:
    """Lower is better: a language model's perplexity, or an image transformer's top-1 error."""
    return scores["perplexity"] if "perplexity" in scores else 1.0 - scores["accuracy"]


def _heads(model: nn.Module) -> int | None:
    from optkit.passes.prune.hf.structure import HEAD_FIELDS, config_int

    return config_int(model.config, HEAD_FIELDS)


def _intermediate(model: nn.Module) -> int | None:
    from optkit.passes.prune.hf.transformer import WIDTH_FIELDS

    return next((getattr(model.config, f) for f in WIDTH_FIELDS if isinstance(getattr(model.config, f, None), int)),
                None)


def _search_blockwise(target: MixTarget, spec: PruneSpec, model: nn.Module, structure: Any, measure: Any,
                      original: int) -> PassResult:
    """The mix search in bounded memory: plans sized on the meta device, scored together in one pass over the
    blocks (:func:`~optkit.passes.prune.hf.candidates.score_plans`), the best cut in place. The validation rows
    (evenly spaced across the split, as the calibration rows are) are read only once the scoring is known to fit
    its time budget."""
    import torch

    from optkit.passes.prune.hf.candidates import MIN_ROWS, score_plans, val_rows
    from optkit.passes.prune.hf.calibration import calibration_text
    from optkit.passes.prune.hf.entry import compute_device, prune_planned

    plans = mix_plans(model, structure, target)
    if not plans:
        raise ValueError(f"no mix of heads and MLP channels reaches {target.measured} {target.fraction:g} within "
                         f"{max(target.tolerance, 0.02):g}; use allocation uniform")
    calibration = calibration_text(model, spec)
    refit = calibration is not None and spec.bias_correction
    device = compute_device(model, spec)
    rows, estimate = val_rows(model, structure, calibration, len(plans), VAL_BLOCKS, SCORE_BUDGET_S, device)
    if rows is None and target.measured_by_default:
        return _uniform_instead(target, dataclasses.replace(spec, calibration=calibration), model, estimate, structure)
    ids, mask, targets = _val_rows(model, spec)
    rows = min(rows or MIN_ROWS, len(ids))
    with torch.no_grad():
        perplexities = score_plans(model, structure, [plan for plan, _ in plans], calibration,
                                   {"input_ids": ids[:rows], "attention_mask": mask[:rows]}, targets[:rows],
                                   importance=spec.importance, refit=refit, device=device)
    attention = structure.attentions[0]
    candidates = [{"heads": plan.heads(), "kv_heads": plan.kv_keep, "intermediate": sorted(plan.mlp_keep.values()),
                   "planned_fraction": round(planned, 4), "val_loss": round(ppl, 4)}
                  for (plan, planned), ppl in zip(plans, perplexities, strict=True)]
    best = min(range(len(plans)), key=lambda i: perplexities[i])
    plan = plans[best][0]
    details = prune_planned(model, spec, plan, structure, batches=calibration)
    achieved = measure(model) / original
    details.update({"allocation": "mix", "target": target.measured, "target_fraction": target.fraction,
                    "achieved_fraction": round(achieved, 4), "val_measure": "perplexity", "val_rows": rows,
                    "candidates": candidates, "heads_ratio": 1 - plan.heads() / attention.heads})
    details["notes"].append(
        f"structured_prune kept {plan.heads()} heads ({plan.kv_keep} key/value groups) and "
        f"{', '.join(map(str, sorted(plan.mlp_keep.values())))} MLP channels per block ({target.measured} "
        f"{achieved:.3f}): the lowest validation perplexity ({perplexities[best]:.3f}, on {rows} rows) of "
        f"{len(plans)} mixes of heads and MLP channels")
    return PassResult(model, details)


def _val_rows(model: nn.Module, spec: PruneSpec) -> tuple[Any, Any, Any]:
    """:data:`VAL_BLOCKS` rows of the text's ``val`` split, evenly spaced across it: token ids, attention mask and
    the next token at each position but the last (ignored past the text)."""
    from optkit.kinds.tokens import IGNORE
    from optkit.passes.prune.hf.calibration import spread_blocks

    ids, mask = spread_blocks(model, spec.data, "val", spec.input_shape[-1], VAL_BLOCKS)
    return ids, mask, ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)


def mix_plans(model: nn.Module, structure: Any, target: MixTarget) -> list[tuple[Any, float]]:
    """The plans tried: for each head option (none removed; the options nearest :data:`HEAD_SHARES`; every
    whole key/value group option up to half the heads; the heads the uniform cut keeps, however many it
    removes, so that the measured split is never one the uniform cut beats on the rows it is scored on), the MLP
    width that meets the target, sized on the meta device; ``(plan, planned fraction)`` for those within the
    target's tolerance (at least 0.02)."""
    from optkit.passes.prune.hf.blockwise import Plan, check_plan, fit_mlp, full_plan, head_options
    from optkit.passes.prune.targets.ratio import uniform_heads

    attention = structure.attentions[0]
    heads, kv = attention.heads, attention.kv_heads
    whole = full_plan(structure)
    options = [(kv, attention.groups)]
    valid = [o for o in head_options(heads, kv) if 1 - o[0] * o[1] / heads <= max(HEAD_SHARES)
             and check_plan(model, Plan(o[0], o[1], whole.mlp_keep), structure) is None]
    for share in HEAD_SHARES[1:]:
        if valid:
            options.append(min(valid, key=lambda o: (abs(1 - o[0] * o[1] / heads - share), -o[0])))
    options += [o for o in valid if o[1] == attention.groups]
    uniform = uniform_heads(_uniform_target(target), model, structure)
    if uniform is not None:
        options.append(uniform)
    options = list(dict.fromkeys(options))
    tolerance = max(target.tolerance, 0.02)
    plans = []
    for kv_keep, q_keep in options:
        fitted = fit_mlp(model, structure, kv_keep, q_keep, target.fraction, target.measured, target.round_to,
                         MAX_MLP_SHARE)
        if fitted is not None and abs(fitted[1] - target.fraction) <= tolerance:
            plans.append(fitted)
    return plans


def _uniform_instead(target: MixTarget, spec: PruneSpec, model: nn.Module, estimate: float,
                     structure: Any) -> PassResult:
    """The default allocation on a model too large to score its plans within :data:`SCORE_BUDGET_S`: the uniform
    cut (of ``structure``, the first block as parsed here), with a note saying why and how to measure anyway."""
    from optkit.passes.prune.targets.ratio import search as uniform_search

    result = uniform_search(_uniform_target(target), spec, model, structure=structure)
    result.details["allocation"] = "uniform (split not measured: over its time budget)"
    result.details.setdefault("notes", []).insert(0, (
        f"structured_prune cut heads and MLP channels by the same share: measuring the split (the default for a "
        f"language model) would take about {estimate:.0f} s on this machine, over its budget of "
        f"{SCORE_BUDGET_S:.0f} s; --allocation sensitivity measures it anyway"))
    return result


def _uniform_target(target: MixTarget) -> Any:
    """The uniform cut's target for the same fraction of the same measure."""
    from optkit.passes.prune.targets.configs import MacsTarget, ParamsTarget

    kind = MacsTarget if target.measured == "macs" else ParamsTarget
    return kind(target.fraction, target.tolerance, target.round_to)
