"""A transformer's parameter or MACs target, with the cut split between heads and MLP channels by measurement.

Removing the same share of attention heads and of MLP channels (the uniform
path) is one way to reach a target; a language model often keeps more when
the cut falls mostly on one of them. :class:`~optkit.passes.prune.targets.configs.MixTarget`
tries each head share the structure allows (whole heads, the same number
from every key/value group: at most :data:`HEAD_SHARES` of them), finds for
each the MLP share that reaches the target (parameters and MACs fall
linearly with the MLP width, so two trial prunes give it), prunes a copy at
that mix with the pass's importance and refit, and scores it on the first
:data:`VAL_BLOCKS` samples of the data's ``val`` split (perplexity on text; an
image transformer's top-1 error on images).
The mix with the lowest perplexity is kept. Widths stay uniform across
blocks, so the stock class still describes the result.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from optkit.core.contract import PassResult
from optkit.passes.prune.graph.channels import PruneSpec, prune_to
from optkit.passes.prune.targets.configs import MixTarget, handles

if TYPE_CHECKING:
    from torch import nn

#: Head shares tried (before rounding to whole heads): none, then up to half of them.
HEAD_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5)
#: Validation blocks each candidate is scored on.
VAL_BLOCKS = 64
#: The MLP share is capped here: a block keeps at least a few channels.
MAX_MLP_SHARE = 0.9


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
    from optkit.analysis.metrics import count_macs, count_params
    from optkit.data.specs import is_text

    def measure(m: nn.Module) -> int:
        return count_macs(m, spec.input_shape) if target.measured == "macs" else count_params(m)

    original = measure(model)
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
