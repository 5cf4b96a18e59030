"""``optkit inspect``: the per-layer table of a model, its totals, and what a structured prune would skip."""

from __future__ import annotations

import json

import click

from optkit.cli._options import model_options


@click.command("inspect")
@click.argument("model")
@model_options("Input shape MACs are counted at, e.g. 1,3,224,224.")
@click.option("--all-layers", is_flag=True, help="Also list rows without parameters (activations, pooling).")
@click.option("--json", "as_json", is_flag=True, help="Print the table, totals and skipped layers as JSON.")
def inspect_command(model: str, input_shape, num_classes, arch, trust, all_layers: bool, as_json: bool) -> None:
    """Show MODEL layer by layer: channels, parameters, MACs, sparsity.

    The totals equal the before/after figures optimize writes to report.json
    for the same model and input shape.

    Example: optkit inspect torchvision:resnet18 --input-shape 1,3,224,224
    """
    from optkit.analysis.model_info import inspect_model
    from optkit.io import models
    from optkit.passes.prune.passes import skipped_layers

    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or models.infer_input_shape(loaded)
    inspection = inspect_model(loaded.model, shape, prune_dry_run=skipped_layers)
    if as_json:
        click.echo(json.dumps({"model": model, **inspection.to_dict()}, indent=2))
        return
    _print(model, inspection, all_layers)


def _print(model: str, inspection, all_layers: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from optkit.analysis.model_info import format_table

    console = Console()
    if not console.is_terminal:
        # Piped or captured output has no width to respect: don't fold names and numbers.
        console = Console(width=200)
    shape = "×".join(map(str, inspection.input_shape))
    table = Table(title=f"{model} at {shape}")
    for column in ("layer", "type", "in", "out", "params", "MACs", "sparsity"):
        table.add_column(column, justify="left" if column in ("layer", "type") else "right", overflow="fold")
    rows = format_table(inspection, all_layers=all_layers)
    for row in rows:
        table.add_row(*row)
    table.add_section()
    table.add_row("total", "", "", "", f"{inspection.params:,}", f"{inspection.macs:,}", f"{inspection.sparsity:.1%}")
    console.print(table)
    hidden = len(inspection.layers) - len(rows)
    if hidden:
        hidden_macs = sum(layer.macs for layer in inspection.layers if not layer.listed)
        console.print(f"{hidden} rows without parameters (activations, pooling: {hidden_macs:,} MACs) "
                      "are counted in the totals but not listed; --all-layers lists them.")
    if inspection.prune_error is not None:
        console.print(f"A structured prune (optkit optimize --prune) cannot trace this model: {inspection.prune_error}",
                      markup=False)
    elif inspection.skipped_layers:
        console.print("A structured prune (optkit optimize --prune) leaves these layers untouched:")
        for name, reason in inspection.skipped_layers.items():
            console.print(f"  {name}: {reason}", markup=False)
    else:
        console.print("A structured prune (optkit optimize --prune) would change every conv/linear layer.")
