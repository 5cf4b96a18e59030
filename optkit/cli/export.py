"""``optkit export``: write a model as a verified ONNX file."""

from __future__ import annotations

from pathlib import Path

import click

from optkit.cli._options import parse_shape


@click.command("export")
@click.argument("model")
@click.option("--onnx", "onnx_path", required=True, type=click.Path(dir_okay=False),
              help="Destination ONNX file.")
@click.option("--input-shape", callback=parse_shape, help="Example input shape, e.g. 1,3,224,224.")
@click.option("--opset", type=click.IntRange(min=7), help="ONNX opset (default 18).")
@click.option("--fp16", is_flag=True, help="Store weights as fp16 (half the file); compute stays fp32.")
@click.option("--static-batch", is_flag=True, help="Fix the batch dimension instead of making it dynamic.")
@click.option("--exporter", type=click.Choice(["auto", "torchscript", "dynamo"]), default="auto", show_default=True,
              help="torch ONNX exporter; auto tries TorchScript, then dynamo.")
@click.option("--simplify", is_flag=True, help="Simplify the graph with onnxslim (verified the same way).")
@click.option("--rtol", type=click.FloatRange(min=0), help="Allowed difference relative to the largest output (default 1e-3; 2e-2 with --fp16).")
@click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture.")
@click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME or package.module:Class.")
@click.option("--trust", is_flag=True, help="Allow full unpickling (runs code from the file): only for files you trust.")
@click.option("--force", is_flag=True, help="Overwrite an existing ONNX file.")
def export_command(model: str, onnx_path: str, input_shape, opset, fp16, static_batch, exporter, simplify, rtol,
                   num_classes, arch, trust, force) -> None:
    """Export MODEL (torchvision:NAME or a checkpoint file) to ONNX, verified against PyTorch.

    Example: optkit export runs/demo/model.pt --onnx runs/demo/model-fp16.onnx --fp16
    """
    from optkit import workflow
    from optkit.io import models
    from optkit.core.errors import OptkitError
    from optkit.export.onnx import export_onnx

    if Path(onnx_path).exists() and not force:
        raise OptkitError(f"{onnx_path} already exists; pass --force to overwrite it or choose another --onnx path")
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or models.default_input_shape(model)
    workflow.check_runs(loaded, shape)
    result = export_onnx(loaded.model, onnx_path, shape, opset=opset, dynamic_batch=not static_batch, fp16=fp16,
                         exporter=exporter, simplify=simplify, rtol=rtol)
    checks = ", ".join(f"batch {v.batch_size}: max |diff| {v.max_abs_diff:.2g} <= {v.tolerance:.2g}" for v in result.verification)
    click.echo(f"Wrote {result.path} ({result.file_size:,} bytes, {result.compressed_size:,} gzipped) "
               f"with the {result.exporter} exporter, opset {result.opset}")
    click.echo(f"Verified with ONNX Runtime: {checks}")
    for note in result.notes:
        click.echo(f"note: {note}")
