"""``optkit optimize``: build a pipeline from flags or a recipe, run it, write the results.

The pass flags are generated from the registered passes' declarations
(:mod:`optkit.cli.generated`); flags build the same structure as a recipe file
(a list of ``[[pass]]`` tables), which goes through the same strict
validation, and every run writes the recipe it ran. ``--export onnx`` and
``--int8`` add the ``export_onnx`` and ``int8`` steps like any other pass flag,
so the recipe reads prune, fine-tune, export, int8.
"""

from __future__ import annotations

from typing import Any

import click

from optkit.cli import _run, generated
from optkit.cli._options import eval_options, eval_settings, model_options, output_options
from optkit.cli._run import builtin_classes, show_epoch_lines

_CLASSES = builtin_classes()
_FLAGS = generated.pass_flags(_CLASSES.values())


def _pass_options() -> list:
    options = [generated.variant_option(name, choices) for name, choices in generated.variants(_CLASSES.values()).items()]
    for flag in _FLAGS.values():
        if flag.spec is None:
            options.append(generated.switch_option(flag, _CLASSES))
        else:
            options.append(generated.setting_option(flag))
    return [*options, generated.pass_option()]


@click.command("optimize")
@click.argument("model")
@generated.with_options(_pass_options())
@model_options()
@eval_options()
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False),
              help="Run the passes of this TOML recipe instead of building them from flags.")
@output_options("the result (a save_pretrained folder for a Hugging Face model, else model.pt), recipe.toml, "
                "report.json and report.md")
@click.option("--latency/--no-latency", default=None,
              help="--latency also times the model before and after in PyTorch eager; --no-latency skips the "
                   "ONNX Runtime timing (batch 1, every core) that runs with --export onnx by default.")
def optimize_command(model: str, input_shape, num_classes, arch, trust, recipe_path, out_dir, force, save_pt,
                     latency, generic_passes, **flags: Any) -> None:
    """Slim MODEL (torchvision:NAME or a checkpoint file) and write the result and a report.

    Example: optkit optimize torchvision:resnet18 --prune 0.3 --out runs/demo
    """
    from rich.console import Console

    from optkit import workflow
    from optkit.analysis.report import print_report
    from optkit.io import models
    from optkit.core.progress import show_progress
    from optkit.runtime.distributed import init_distributed, is_main_process

    console = Console(stderr=True)
    evaluation = eval_settings(flags)
    pipeline = _pipeline(recipe_path, input_shape, flags, generic_passes)
    init_distributed()
    show_epoch_lines()
    for note in pipeline.notes if is_main_process() else ():
        click.echo(f"note: {note}", err=True)
    with console.status(f"loading {model}"):
        loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    if not pipeline.input_shape_given:
        pipeline.input_shape = (_run.data_input_shape(loaded.model, flags["finetune"]) if flags.get("finetune")
                                else models.infer_input_shape(loaded))

    def on_pass(index: int, total: int, name: str) -> None:
        console.print(f"[{index + 1}/{total}] running {name}")

    with show_progress(lambda line: console.print(f"  {line}", markup=False, highlight=False)):
        report = workflow.optimize(loaded, pipeline, out_dir, force=force, on_pass=on_pass, latency=latency,
                                   evaluation=evaluation, resume=bool(flags.get("resume")), save_pt=save_pt)
    if is_main_process():
        print_report(report, Console())
        click.echo(_run.wrote_line(report, out_dir))


def _pipeline(recipe_path: str | None, input_shape, flags: dict[str, Any], generic: tuple[str, ...]):
    from optkit.core.pipeline import Pipeline

    if recipe_path is not None:
        pipeline = Pipeline.load(recipe_path)
        overrides, flags = generated.recipe_overrides(flags, _CLASSES, {p.name for p in pipeline.passes})
        pipeline.passes = [_overridden(p, overrides.get(p.name, {})) for p in pipeline.passes]
        return _recipe_pipeline(pipeline, pass_entries_from_flags(flags, generic), input_shape)
    entries = pass_entries_from_flags(flags, generic)
    if not entries:
        raise click.UsageError("nothing to do: give --prune RATIO, --target-macs FRACTION, --finetune SPEC (or another "
                               "pass flag, or --pass NAME) or --recipe FILE")
    data: dict[str, Any] = {"pass": entries}
    if input_shape is not None:
        data["input_shape"] = list(input_shape)
    if flags.get("device") is not None:
        data["device"] = flags["device"]
    return Pipeline.from_dict(data, source="command-line flags")


def _overridden(step, settings: dict[str, Any]):
    """A recipe step with the settings its flags override (validated like any setting)."""
    import dataclasses

    if not settings:
        return step
    try:
        return dataclasses.replace(step, **settings)
    except ValueError as e:
        raise click.UsageError(f"{step.name}: {e}") from None


def _recipe_pipeline(pipeline, entries: list[dict[str, Any]], input_shape):
    """A recipe's pipeline, with the file steps the flags add (``--export onnx``, ``--int8``) that it lacks."""
    from optkit.core import recipe
    from optkit.core.forms import TORCH
    from optkit.core.pipeline import check_forms

    file_steps = [e for e in entries if _CLASSES[e["name"]].accepts != TORCH or _CLASSES[e["name"]].produces != TORCH]
    if len(file_steps) < len(entries):
        raise click.UsageError("give either --recipe or pass flags such as --prune, not both")
    present = {p.name for p in pipeline.passes}
    added = recipe.from_dict({"pass": [e for e in file_steps if e["name"] not in present]},
                             source="command-line flags")["passes"]
    if added:
        check_forms([*pipeline.passes, *added])
        pipeline.passes += added
    if input_shape is not None:
        pipeline.input_shape, pipeline.input_shape_given = input_shape, True
        pipeline.input_shape_origin = None
    return pipeline


def pass_entries_from_flags(flags: dict[str, Any], generic: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Recipe ``[[pass]]`` entries for the pass flags given (``None``: not given), in pipeline order."""
    return _interleave_steps(generated.entries_from_flags(flags, _CLASSES, generic=generic))


def _interleave_steps(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With a training pass, the one entry whose pass splits it for training becomes its parts, each followed by
    the recovery passes (those up to the training stage).

    A pass class says how its entry splits with ``split_for_training(entry)`` (``structured_prune``:
    ``iterative_steps`` prunes whose ratios compound to its ratio); nothing here knows a pass's settings.
    """
    from optkit.core.contract import Stage

    stages = {e["name"]: _CLASSES[e["name"]].stage if e["name"] in _CLASSES else Stage.TRANSFORM for e in entries}
    splits = [(e, parts) for e in entries if len(parts := _split_for_training(e)) > 1]
    if len(splits) != 1 or not any(stages[e["name"]] == Stage.TRAIN for e in entries):
        return entries
    entry, parts = splits[0]
    position = entries.index(entry)
    recover = [e for e in entries[position + 1:] if stages[e["name"]] <= Stage.TRAIN]
    rest = [e for e in entries[position + 1:] if stages[e["name"]] > Stage.TRAIN]
    repeated = [dict(e) for part in parts for e in (part, *recover)]
    return entries[:position] + repeated + rest


def _split_for_training(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries a pass runs in place of ``entry`` with a training pass after each (a pass class may say)."""
    split = getattr(_CLASSES.get(entry["name"]), "split_for_training", None)
    return split(entry) if split is not None else [entry]
