"""``optkit export``: write a model as a verified ONNX file (and its INT8 model): the ``export_onnx`` and ``int8``
passes run on their own; the options come from :class:`ExportSettings` and :class:`Int8Settings`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from optkit.cli import generated
from optkit.cli._options import eval_options, eval_settings, model_options
from optkit.cli._run import int8_options
from optkit.export.settings import ExportSettings
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.quantize.passes import Int8
from optkit.passes.quantize.passes import int8_path as int8_file
from optkit.passes.quantize.settings import Int8Settings

_FLAGS = generated.settings_flags(ExportSettings)
_INT8_FLAGS = generated.settings_flags(Int8Settings)


@click.command("export")
@click.argument("model")
@click.option("--onnx", "onnx_path", required=True, type=click.Path(dir_okay=False), help="Destination ONNX file.")
@generated.with_options([generated.setting_option(flag) for flag in _FLAGS.values()])
@generated.with_options(int8_options(_INT8_FLAGS, "Also write the INT8 model beside the ONNX file (NAME.int8.onnx), "
                                                 "quantized and checked on the task (needs --calib-data)."))
@model_options()
@eval_options()
@click.option("--force", is_flag=True, help="Overwrite an existing ONNX file.")
def export_command(model: str, onnx_path: str, input_shape, num_classes, arch, trust, force, int8, **flags) -> None:
    """Export MODEL (torchvision:NAME or a checkpoint file) to ONNX, verified against PyTorch.

    Example: optkit export runs/demo/model.pt --onnx runs/demo/model-fp16.onnx --fp16
    """
    from optkit import workflow
    from optkit.core.errors import OptkitError
    from optkit.io import models
    from optkit.io.outputs import StagedOutputs

    evaluation = eval_settings(flags)
    export = generated.settings_from_flags(ExportOnnx, _FLAGS, flags)
    int8_given = [f"--{f.name}" for f in _INT8_FLAGS.values() if flags.get(f.param) is not None]
    if int8_given and not int8:
        raise click.UsageError(f"{', '.join(int8_given)} set INT8 quantization: add --int8")
    int8_step = generated.settings_from_flags(Int8, _INT8_FLAGS, flags) if int8 else None
    int8_path = int8_file(onnx_path)
    for target in [Path(onnx_path), *([int8_path] if int8 else [])]:
        if target.exists() and not force:
            raise OptkitError(f"{target} already exists; pass --force to overwrite it or choose another --onnx path")
    if int8_step is not None and int8_step.calib_data:
        from optkit.data import check_available

        check_available(int8_step.calib_data)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or models.infer_input_shape(loaded)
    workflow.check_runs(loaded, shape)
    scorer = workflow.Scorer(evaluation, loaded.model, shape) if evaluation is not None else None
    target = Path(onnx_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Both files appear together or neither does: a refused INT8 model leaves the folder as it was.
    with StagedOutputs(target.parent) as staged:
        steps = [dataclasses.replace(export, input_shape=shape, path=str(staged.path(target.name))).apply(loaded.model)]
        if int8_step is not None:
            steps.append(dataclasses.replace(int8_step, input_shape=shape).apply(steps[0].model))
        for step in steps if scorer is not None else ():
            scorer.score_onnx(step.model.path.name, step.model.path)
    result = steps[0].details
    checks = ", ".join(f"batch {v['batch_size']}: max |diff| {v['max_abs_diff']:.2g} <= {v['tolerance']:.2g}"
                       for v in result["verification"])
    click.echo(f"Wrote {target} ({result['file_size']:,} bytes, {result['compressed_size']:,} gzipped) "
               f"with the {result['exporter']} exporter, opset {result['opset']}")
    click.echo(f"Verified with ONNX Runtime: {checks}")
    for line in [*(f"note: {note}" for note in result["notes"]), *(_int8_lines(s.details) for s in steps[1:])]:
        click.echo(line)
    if scorer is not None:
        _print_scores(scorer)


def _int8_lines(section: dict) -> str:
    """What the INT8 step wrote, checked and timed, as lines."""
    lines = [f"Wrote {Path(section['path']).name} beside it ({section['int8_size']:,} bytes)"]
    lines += [f"note: {note}" for note in section["notes"]]
    lines += [f"ONNX Runtime, batch {run['batch_size']}, {run['threads']} thread(s): FP32 "
              f"{run['fp32']['median_ms']:.2f} ms, INT8 {run['int8']['median_ms']:.2f} ms "
              f"({run['speedup']:.2f}x{', noisy' if run['noisy'] else ''})" for run in section["latency"]["runs"]]
    return "\n".join(lines)


def _print_scores(scorer) -> None:
    from rich.console import Console

    from optkit.analysis.report import evaluation_table

    Console().print(evaluation_table(scorer.section()))
