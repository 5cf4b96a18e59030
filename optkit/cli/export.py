"""``optkit export``: write a model as a verified ONNX file; its options come from :class:`ExportSettings`."""

from __future__ import annotations

from pathlib import Path

import click

from optkit.cli import generated
from optkit.cli._options import model_options
from optkit.export.settings import ExportSettings

_FLAGS = generated.settings_flags(ExportSettings)


@click.command("export")
@click.argument("model")
@click.option("--onnx", "onnx_path", required=True, type=click.Path(dir_okay=False), help="Destination ONNX file.")
@generated.with_options([generated.setting_option(flag) for flag in _FLAGS.values()])
@model_options()
@click.option("--force", is_flag=True, help="Overwrite an existing ONNX file.")
def export_command(model: str, onnx_path: str, input_shape, num_classes, arch, trust, force, **flags) -> None:
    """Export MODEL (torchvision:NAME or a checkpoint file) to ONNX, verified against PyTorch.

    Example: optkit export runs/demo/model.pt --onnx runs/demo/model-fp16.onnx --fp16
    """
    from optkit import workflow
    from optkit.core.errors import OptkitError
    from optkit.export.onnx import export_onnx
    from optkit.io import models

    settings = generated.settings_from_flags(ExportSettings, _FLAGS, flags)
    if Path(onnx_path).exists() and not force:
        raise OptkitError(f"{onnx_path} already exists; pass --force to overwrite it or choose another --onnx path")
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or models.infer_input_shape(loaded)
    workflow.check_runs(loaded, shape)
    result = export_onnx(loaded.model, onnx_path, shape, **settings.export_kwargs())
    checks = ", ".join(f"batch {v.batch_size}: max |diff| {v.max_abs_diff:.2g} <= {v.tolerance:.2g}" for v in result.verification)
    click.echo(f"Wrote {result.path} ({result.file_size:,} bytes, {result.compressed_size:,} gzipped) "
               f"with the {result.exporter} exporter, opset {result.opset}")
    click.echo(f"Verified with ONNX Runtime: {checks}")
    for note in result.notes:
        click.echo(f"note: {note}")
