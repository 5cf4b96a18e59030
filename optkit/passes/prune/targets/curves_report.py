"""What ``optkit sensitivity`` writes: the curves as a table (JSON, Markdown), a plot, and the recipe they give."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optkit.passes.prune.targets.curves import Sensitivity
    from optkit.passes.prune.passes import StructuredPrune

OUTPUT_FILES = ("sensitivity.json", "sensitivity.md", "sensitivity.png", "recipe.toml")
#: Curves beyond this many share one legend entry ("other groups").
LEGEND_LIMIT = 12


def write_outputs(folder: Path, sensitivity: Sensitivity, recipe_pass: StructuredPrune,
                  allocation: dict[str, Any], model_spec: str) -> None:
    """Write :data:`OUTPUT_FILES` into ``folder`` (a staging folder: the caller publishes them together).

    Args:
        folder: where the files go.
        sensitivity: the analysis.
        recipe_pass: the structured prune with the allocated ``layer_ratios``.
        allocation: the sensitivity search's details (``target_fraction``, ``achieved_fraction``,
            ``predicted_loss``, ``layer_ratios``).
        model_spec: the MODEL argument, for titles.
    """
    from optkit.core import recipe

    summary = {"model": model_spec, **sensitivity.to_dict(),
               "allocation": {k: allocation[k] for k in ("target_fraction", "achieved_fraction", "predicted_loss",
                                                         "layer_ratios", "spread", "candidates") if k in allocation}}
    (folder / "sensitivity.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (folder / "sensitivity.md").write_text(markdown(sensitivity, allocation, model_spec), encoding="utf-8")
    plot(sensitivity, folder / "sensitivity.png", model_spec)
    shape = tuple(sensitivity.settings["input_shape"])
    (folder / "recipe.toml").write_text(recipe.dumps([recipe_pass], input_shape=shape), encoding="utf-8")


def markdown(sensitivity: Sensitivity, allocation: dict[str, Any], model_spec: str) -> str:
    """The curves as a Markdown table: per group and ratio, channels kept, mean KL and accuracy; then the allocation."""
    ratios = sorted(sensitivity.settings["ratios"])
    s = sensitivity.settings
    base = sensitivity.baseline
    lines = [f"# Sensitivity of {model_spec}", "",
             f"Each group pruned alone on a copy (round_to {s['round_to']}, {s['importance']} importance), BatchNorm "
             f"recalibrated on {s['calibration_samples']} training images, scored on {s['samples']} val images of "
             f"`{s['data']}` at input {'×'.join(map(str, s['input_shape']))}. The unpruned model recalibrated alike "
             f"(each curve's zero point, from which losses count): accuracy {base['accuracy']:.2%}, mean KL "
             f"{base['mean_kl']:.4f} and agreement {base['agreement']:.1%} with the original. Cells: channels kept / "
             "mean KL from the original / accuracy (both recalibrated) / top-1 agreement with the original as pruned "
             f"(before recalibration). Allocation loss: {sensitivity.loss_description()}.", "",
             "| group | channels | MACs share | " + " | ".join(f"ratio {r:g}" for r in ratios) + " | allocated |",
             "|---|---:|---:|" + "---:|" * (len(ratios) + 1)]
    chosen = allocation.get("layer_ratios", {})
    for curve in sensitivity.curves:
        cells = {p.ratio: f"{p.kept} / {p.mean_kl:.4f} / {p.accuracy:.1%} / {p.as_pruned_agreement:.1%}"
                 for p in curve.points}
        kept = curve.channels - int(round(chosen.get(curve.pattern, 0.0) * curve.channels + 1e-6))
        lines.append(f"| {curve.pattern} | {curve.channels} | {curve.macs_share:.3f} | "
                     + " | ".join(cells.get(r, "not measured") for r in ratios) + f" | {kept} |")
    cost = sensitivity.cost
    lines += ["", f"Allocation for MACs {allocation['target_fraction']:g}: achieved "
              f"{allocation['achieved_fraction']:.3f}, predicted loss {allocation['predicted_loss']:.4f}"
              "; recipe.toml holds its layer_ratios.", *_candidate_lines(allocation),
              f"Cost: {cost['seconds']:.1f} s, {cost['measured']} points measured, {cost['cached']} from the cache."]
    if sensitivity.unmeasured:
        lines.append(f"Time budget reached: {len(sensitivity.unmeasured)} group(s) not measured and not pruned "
                     f"({', '.join(sensitivity.unmeasured)}).")
    return "\n".join(lines) + "\n"


def _candidate_lines(allocation: dict[str, Any]) -> list[str]:
    candidates = [c for c in allocation.get("candidates", []) if "measured_loss" in c]
    if len(candidates) < 2:
        return []
    lines = ["", "Allocations made and measured whole on the same images (spread: share of the loss that penalizes "
             "uneven cuts); the least measured loss is kept:", "",
             "| spread | MACs | predicted loss | agreement as pruned | agreement recalibrated | mean KL recalibrated "
             "| measured loss |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in candidates:
        mark = " (kept)" if c["spread"] == allocation.get("spread") else ""
        lines.append(f"| {c['spread']:g}{mark} | {c['achieved_fraction']:.3f} | {c['predicted_loss']:.4f} | "
                     f"{c['as_pruned_agreement']:.1%} | {c['agreement']:.1%} | {c['mean_kl']:.4f} | "
                     f"{c['measured_loss']:.4f} |")
    return lines + [""]


def plot(sensitivity: Sensitivity, path: Path, model_spec: str) -> None:
    """One curve per group: the loss metric against the fraction of its channels removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, curve in enumerate(sensitivity.curves):
        if not curve.points:
            continue
        xs = [0.0] + [1 - p.kept / curve.channels for p in curve.points]
        ys = [0.0] + [sensitivity.loss(p) for p in curve.points]
        label = curve.pattern if index < LEGEND_LIMIT else ("other groups" if index == LEGEND_LIMIT else None)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=label,
                color=None if index < LEGEND_LIMIT else "0.7")
    ax.set_xlabel("fraction of the group's channels removed")
    ax.set_ylabel("\n".join(textwrap.wrap(sensitivity.loss_description(), 50)), fontsize=8)
    ax.set_title(f"Sensitivity of {model_spec}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
