"""``optkit export``: write a model as a verified ONNX file; its options come from :class:`ExportSettings`."""

from __future__ import annotations

from pathlib import Path

import click

from optkit.cli import generated
from optkit.cli._options import eval_options, eval_settings, model_options
from optkit.cli._run import int8_options
from optkit.passes.quantize.settings import Int8Settings
from optkit.export.settings import ExportSettings

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
    from optkit.export.onnx import export_onnx
    from optkit.io import models
    from optkit.io.outputs import StagedOutputs

    evaluation = eval_settings(flags)
    settings = generated.settings_from_flags(ExportSettings, _FLAGS, flags)
    int8_given = [f"--{f.name}" for f in _INT8_FLAGS.values() if flags.get(f.param) is not None]
    if int8_given and not int8:
        raise click.UsageError(f"{', '.join(int8_given)} set INT8 quantization: add --int8")
    int8_settings = generated.settings_from_flags(Int8Settings, _INT8_FLAGS, flags) if int8 else None
    int8_path = Path(onnx_path).with_suffix(".int8.onnx")
    for target in [Path(onnx_path), *([int8_path] if int8 else [])]:
        if target.exists() and not force:
            raise OptkitError(f"{target} already exists; pass --force to overwrite it or choose another --onnx path")
    if int8_settings is not None and int8_settings.calib_data:
        from optkit.data import check_available

        check_available(int8_settings.calib_data)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    shape = input_shape or models.infer_input_shape(loaded)
    workflow.check_runs(loaded, shape)
    scorer = workflow.Scorer(evaluation, loaded.model, shape) if evaluation is not None else None
    target = Path(onnx_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Both files appear together or neither does: a refused INT8 model leaves the folder as it was.
    with StagedOutputs(target.parent) as staged:
        staged_onnx = staged.path(target.name)
        result = export_onnx(loaded.model, staged_onnx, shape, **settings.export_kwargs())
        staged_int8 = staged.path(int8_path.name) if int8_settings is not None else None
        int8_lines = _write_int8(staged_onnx, staged_int8, int8_settings, shape) if staged_int8 is not None else []
        if scorer is not None:
            _score(scorer, staged_onnx, staged_int8)
    checks = ", ".join(f"batch {v.batch_size}: max |diff| {v.max_abs_diff:.2g} <= {v.tolerance:.2g}"
                       for v in result.verification)
    click.echo(f"Wrote {target} ({result.file_size:,} bytes, {result.compressed_size:,} gzipped) "
               f"with the {result.exporter} exporter, opset {result.opset}")
    click.echo(f"Verified with ONNX Runtime: {checks}")
    for line in [*(f"note: {note}" for note in result.notes), *int8_lines]:
        click.echo(line)
    if scorer is not None:
        _print_scores(scorer)


def _write_int8(fp32_path: Path, int8_path: Path, settings: Int8Settings, shape: tuple[int, ...]) -> list[str]:
    """Quantize the exported file (verified on the task); returns the lines that say what was checked and timed."""
    from optkit import workflow

    section = workflow.quantize_exported(fp32_path, int8_path, settings, shape)
    lines = [f"Wrote {Path(section['path']).name} beside it ({section['int8_size']:,} bytes)"]
    lines += [f"note: {note}" for note in section["notes"]]
    lines += [f"ONNX Runtime, batch {run['batch_size']}, {run['threads']} thread(s): FP32 "
              f"{run['fp32']['median_ms']:.2f} ms, INT8 {run['int8']['median_ms']:.2f} ms "
              f"({run['speedup']:.2f}x{', noisy' if run['noisy'] else ''})" for run in section["latency"]["runs"]]
    return lines


def _score(scorer, onnx_path: Path, int8_path: Path | None) -> None:
    for path in [onnx_path, *([int8_path] if int8_path else [])]:
        scorer.score_onnx(path.name, path)


def _print_scores(scorer) -> None:
    from rich.console import Console

    from optkit.analysis.report import evaluation_table

    Console().print(evaluation_table(scorer.section()))
