"""``optkit sensitivity``: per-group pruning curves on data, and the recipe that spends a MACs target where it is cheapest.

The analysis options come from :class:`optkit.passes.prune.targets.curves.SensitivitySettings`;
``--round-to``, ``--importance`` and ``--target-macs`` are the structured prune's own.
"""

from __future__ import annotations

from typing import Any

import click

from optkit.passes.prune.targets.curves import SensitivitySettings
from optkit.cli import generated
from optkit.cli._options import model_options
from optkit.cli._run import builtin_classes

_FLAGS = generated.settings_flags(SensitivitySettings)
_PRUNE = builtin_classes()["structured_prune"]
_PRUNE_FLAGS = {name: flag for name, flag in generated.pass_flags([_PRUNE]).items()
                if name in ("round-to", "importance", "target-macs")}
DEFAULT_TARGET_MACS = 0.5


def _options() -> list:
    options = []
    for flag in _FLAGS.values():
        options.append(generated.setting_option(flag, required=flag.name == "data"))
    return options + [generated.setting_option(flag) for flag in _PRUNE_FLAGS.values()]


@click.command("sensitivity")
@click.argument("model")
@generated.with_options(_options())
@model_options("Model input, e.g. 1,3,64,64; images are repeated to its channels and resized to its size. "
               "Default: the data's image size with the model's input channels.")
@click.option("--out", "out_dir", default="optkit-sensitivity", show_default=True, type=click.Path(file_okay=False),
              help="Output folder for sensitivity.json, sensitivity.md, sensitivity.png and recipe.toml.")
@click.option("--force", is_flag=True, help="Overwrite results already in the output folder.")
def sensitivity_command(model: str, input_shape, num_classes, arch, trust, out_dir, force, **flags: Any) -> None:
    """Measure how much pruning each layer group of MODEL costs, and write a recipe for a MACs target.

    Each group is pruned alone at each --ratios value on a copy, BatchNorm is
    recalibrated, and the copy is scored on --samples images of the data's val
    split. The recipe's layer_ratios reach --target-macs (default 0.5) with the
    least predicted loss; run it with optkit optimize MODEL --recipe OUT/recipe.toml.
    Measurements are cached: a rerun is instant.

    Example: optkit sensitivity torchvision:resnet18 --data fashion-mnist --input-shape 1,3,64,64
    """
    import dataclasses

    from rich.console import Console

    from optkit import workflow
    from optkit.passes.prune.targets.curves import analyze
    from optkit.passes.prune.targets.curves_report import OUTPUT_FILES, write_outputs
    from optkit.cli._run import data_input_shape
    from optkit.data import check_available, dataset_info
    from optkit.data.adapt import check_fits
    from optkit.io import models
    from optkit.io.outputs import StagedOutputs, prepare_output_dir
    from optkit.passes.prune.targets import sensitivity as sensitivity_target

    settings = generated.settings_from_flags(SensitivitySettings, _FLAGS, flags)
    prune_values = {flag.uses[0].field: flags[flag.param] for flag in _PRUNE_FLAGS.values()
                    if flags.get(flag.param) is not None}
    target = prune_values.pop("target_macs", DEFAULT_TARGET_MACS)
    check_available(settings.data)
    out = prepare_output_dir(out_dir, OUTPUT_FILES, force=force)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or data_input_shape(loaded.model, settings.data)
    workflow.check_runs(loaded, shape)
    check_fits(loaded.model, shape, dataset_info(settings.data).num_classes, settings.data)
    try:
        prune = _PRUNE(ratio=0.0, input_shape=shape, **prune_values)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    console = Console(stderr=True)
    console.print(f"Measuring {model} at {'×'.join(map(str, shape))} on {settings.samples} val images "
                  f"of {settings.data} (time budget {settings.time_budget_s:g} s)")
    sensitivity = analyze(loaded.model, settings, prune, progress=True)
    searched = sensitivity_target.search(
        dataclasses.replace(prune, target_macs=target, allocation="sensitivity", data=settings.data),
        loaded.model, sensitivity)
    details = searched.details
    recipe_pass = dataclasses.replace(prune, layer_ratios=details["layer_ratios"] or None, round_to=details["round_to"],
                                      input_shape=None)
    with StagedOutputs(out) as staged:
        write_outputs(staged.staging, sensitivity, recipe_pass, details, model)
    _print_summary(sensitivity, details, out_dir)


def _print_summary(sensitivity, details: dict[str, Any], out_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=f"Sensitivity at each ratio, lower is safer to prune ({sensitivity.loss_description()})")
    for column in ("group", "channels", "MACs share", *(f"{r:g}" for r in sorted(sensitivity.settings["ratios"]))):
        table.add_column(column, justify="left" if column == "group" else "right")
    for curve in sensitivity.curves:
        losses = {p.ratio: f"{sensitivity.loss(p):.4f}" for p in curve.points}
        table.add_row(curve.pattern, str(curve.channels), f"{curve.macs_share:.3f}",
                      *(losses.get(r, "-") for r in sorted(sensitivity.settings["ratios"])))
    console.print(table)
    cost = sensitivity.cost
    console.print(f"{cost['measured']} points measured, {cost['cached']} from the cache, {cost['seconds']:.1f} s.")
    console.print(f"Allocation for MACs {details['target_fraction']:g}: achieved {details['achieved_fraction']:.3f}, "
                  f"predicted loss {details['predicted_loss']:.4f}; spread {details.get('spread', 0):g}, the least "
                  f"measured loss of {len(details.get('candidates', [])) or 1} allocation(s) pruned and scored whole.")
    for note in details.get("notes", []):
        console.print(note, markup=False)
    click.echo(f"Wrote sensitivity.json, sensitivity.md, sensitivity.png, recipe.toml to {out_dir}")
