"""``optkit export``: write a model as a verified ONNX file (and its INT8 model, OpenVINO IR or chosen deployment):
the ``export_onnx``, ``int8``, ``openvino`` and ``deploy`` passes run on their own; the options come from
:class:`ExportSettings`, :class:`Int8Settings` and the deployment settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from optkit.cli import generated
from optkit.cli._options import eval_options, eval_settings, model_options
from optkit.cli._run import int8_options
from optkit.export.decode import decode_path, unsupported
from optkit.export.settings import ExportSettings
from optkit.passes.deploy.passes import Deploy, OpenVino, openvino_path
from optkit.passes.deploy.settings import CheckSettings
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.quantize.passes import Int8
from optkit.passes.quantize.passes import int8_path as int8_file
from optkit.passes.quantize.settings import Int8Settings

_FLAGS = generated.settings_flags(ExportSettings)
_INT8_FLAGS = generated.settings_flags(Int8Settings)
_CHECK_FIELDS = {f.name for f in dataclasses.fields(CheckSettings)}
#: The task check's flags (--calib-data, --min-agreement ...) are the INT8 ones; they set every step that checks.
_CHECK_FLAGS = {name: flag for name, flag in _INT8_FLAGS.items() if flag.uses[0].field in _CHECK_FIELDS}
_PASSES = {cls.name: cls for cls in (OpenVino, Deploy)}
#: Each deployment pass's own flags (--openvino; --deploy and --deploy-*), as optimize has them.
_OWN_FLAGS = {name: {flag.name: flag for flag in generated.pass_flags([cls]).values()
                     if flag.uses[0].field not in _CHECK_FIELDS} for name, cls in _PASSES.items()}


@click.command("export")
@click.argument("model")
@click.option("--onnx", "onnx_path", required=True, type=click.Path(dir_okay=False), help="Destination ONNX file.")
@generated.with_options([generated.setting_option(flag) for flag in _FLAGS.values()])
@generated.with_options(int8_options(_INT8_FLAGS, "Also write the INT8 model beside the ONNX file (NAME.int8.onnx), "
                                                 "quantized and checked on the task (needs --calib-data)."))
@generated.with_options([generated.switch_option(flag, _PASSES) if flag.spec is None else generated.setting_option(flag)
                         for flags in _OWN_FLAGS.values() for flag in flags.values()])
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
    openvino, deploy = flags.get("openvino") is not None, bool(flags.get("deploy"))
    _check_deployment_flags(flags, int8=int8, openvino=openvino, deploy=deploy)
    int8_step = generated.settings_from_flags(Int8, _INT8_FLAGS, flags) if int8 else None
    deployments = [generated.settings_from_flags(cls, {**_CHECK_FLAGS, **_settings(_OWN_FLAGS[cls.name])}, flags)
                   for cls, asked in ((OpenVino, openvino), (Deploy, deploy)) if asked]
    int8_path = int8_file(onnx_path)
    beside = [int8_path] if int8 or deploy else []
    beside += [openvino_path(onnx_path), openvino_path(onnx_path).with_suffix(".bin")] if openvino or deploy else []
    for target in [Path(onnx_path), *beside]:
        if target.exists() and not force:
            raise OptkitError(f"{target} already exists; pass --force to overwrite it or choose another --onnx path")
    for step in [int8_step, *deployments]:
        if step is not None and step.calib_data:
            from optkit.data import check_available

            check_available(step.calib_data)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    decode_file = decode_path(onnx_path)
    if export.decode_graph and decode_file.exists() and not force and unsupported(loaded.model) is None:
        raise OptkitError(f"{decode_file} already exists; pass --force to overwrite it or choose another --onnx path")
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
        steps += [dataclasses.replace(step, input_shape=shape).apply(steps[0].model) for step in deployments]
        for path in dict.fromkeys(step.model.path for step in steps) if scorer is not None else ():
            scorer.score_onnx(path.name, path)
    result = steps[0].details
    checks = workflow.verification_text(result["verification"], ", ")
    click.echo(f"Wrote {target} ({result['file_size']:,} bytes, {result['compressed_size']:,} gzipped) "
               f"with the {result['exporter']} exporter, opset {result['opset']}")
    click.echo(f"Verified with ONNX Runtime: {checks}")
    if "decode" in result:
        click.echo(f"Wrote {decode_path(target).name} beside it ({result['decode']['file_size']:,} bytes): "
                   "one step with a KV cache, to generate text in ONNX Runtime")
    int8_lines = [_int8_lines(s.details) for s in steps[1:2] if int8]
    deployment_lines = [f"note: {note}" for s in steps[1 + int8:] for note in s.details["notes"]]
    for line in [*(f"note: {note}" for note in result["notes"]), *int8_lines, *deployment_lines]:
        click.echo(line)
    if scorer is not None:
        _print_scores(scorer)


def _check_deployment_flags(flags: dict, *, int8: bool, openvino: bool, deploy: bool) -> None:
    """Refuse settings of steps that do not run, and --deploy with the steps whose files it chooses among."""
    def given(group: dict) -> list[str]:
        return [f"--{flag.name}" for flag in group.values() if flags.get(flag.param) is not None]

    if deploy and (int8 or openvino):
        raise click.UsageError("--deploy chooses among ONNX Runtime INT8 and OpenVINO itself: drop --int8 and "
                               "--openvino")
    only_int8 = [name for name in given(_INT8_FLAGS) if name[2:] not in _CHECK_FLAGS]
    if only_int8 and not int8:
        raise click.UsageError(f"{', '.join(only_int8)} set INT8 quantization: add --int8")
    if given(_CHECK_FLAGS) and not (int8 or openvino or deploy):
        raise click.UsageError(f"{', '.join(given(_CHECK_FLAGS))} set INT8 quantization: add --int8 (or --openvino "
                               "or --deploy, which check their models the same way)")
    deploy_given = given(_settings(_OWN_FLAGS["deploy"]))
    if deploy_given and not deploy:
        raise click.UsageError(f"{', '.join(deploy_given)} set how --deploy chooses: add --deploy")


def _settings(flags: dict) -> dict:
    """The flags that set a setting (a pass's on/off switch left out)."""
    return {name: flag for name, flag in flags.items() if flag.spec is not None}


def _int8_lines(section: dict) -> str:
    """What the INT8 step wrote, checked and timed, as lines."""
    lines = [f"Wrote {Path(section['path']).name} beside it ({section['int8_size']:,} bytes)"]
    lines += [f"note: {note}" for note in section["notes"]]
    lines += [f"ONNX Runtime, batch {run['batch_size']}, {run['threads']} thread(s): FP32 "
              f"{run['fp32']['median_ms']:.2f} ms, INT8 {run['int8']['median_ms']:.2f} ms "
              + (f"({run['not_a_result']})" if run.get("not_a_result") else
                 f"({run['speedup']:.2f}x{', noisy' if run['noisy'] else ''})") for run in section["latency"]["runs"]]
    return "\n".join(lines)


def _print_scores(scorer) -> None:
    from rich.console import Console

    from optkit.analysis.report import evaluation_table

    Console().print(evaluation_table(scorer.section()))
