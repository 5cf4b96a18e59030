"""``optkit finetune``: train a (pruned) model on a dataset to recover accuracy.

The training options are generated from the ``finetune`` pass's declared
settings, the same ones ``optkit optimize --finetune SPEC`` takes. Both
commands run the same way under ``torchrun --nproc_per_node=N -m optkit ...``
(DistributedDataParallel; only rank 0 writes files).
"""

from __future__ import annotations

from typing import Any

import click

from optkit.cli import generated
from optkit.cli._options import eval_options, eval_settings, model_options, output_options
from optkit.cli._run import builtin_classes, data_input_shape, show_epoch_lines, wrote_line
from optkit.core.settings import SHARED_SETTINGS

_FINETUNE = builtin_classes()["finetune"]
_FLAGS = generated.pass_flags([_FINETUNE])


def _training_options() -> list:
    options = []
    for flag in _FLAGS.values():
        enabling = any(use.enables for use in flag.uses)
        options.append(generated.setting_option(generated.Flag("data", flag.uses, flag.spec, flag.annotation),
                                                required=True) if enabling else generated.setting_option(flag))
    device = SHARED_SETTINGS["device"]
    options.append(generated.setting_option(generated.Flag("device", [], device, "str | None")))
    return options


@click.command("finetune")
@click.argument("model")
@generated.with_options(_training_options())
@click.option("--teacher", "teacher_spec", help="Model to distil from with --distill (e.g. the model before pruning).")
@model_options("Model input, e.g. 1,3,28,28; samples are repeated to its channels and resized to its size. "
               "Default: the data's image size with the model's input channels.")
@eval_options()
@output_options("the result (a save_pretrained folder for a Hugging Face model, else model.pt), recipe.toml, "
                "report.json, report.md and finetune.ckpt")
def finetune_command(model: str, teacher_spec, input_shape, num_classes, arch, trust, out_dir, force, save_pt,
                     **flags: Any) -> None:
    """Fine-tune MODEL on --data and write the trained model and a report.

    Example: optkit finetune runs/pruned/model.pt --data fashion-mnist --epochs 2 --distill --teacher base.pt
    """
    from rich.console import Console

    from optkit import workflow
    from optkit.analysis.report import print_report
    from optkit.core.pipeline import Pipeline
    from optkit.io import models
    from optkit.runtime.distributed import init_distributed, is_main_process

    evaluation = eval_settings(flags)
    if flags.get("distill") and teacher_spec is None:
        raise click.UsageError("--distill needs --teacher MODEL (the model before pruning)")
    data = flags["data"]
    entries = generated.entries_from_flags({**flags, "finetune": data}, {"finetune": _FINETUNE})
    init_distributed()
    show_epoch_lines()
    console = Console(stderr=True)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    teacher = models.load_model(teacher_spec, arch=arch, num_classes=num_classes, trust=trust) if teacher_spec else None
    shape = input_shape or data_input_shape(loaded.model, data)
    recipe = {"input_shape": list(shape), "pass": entries}
    if flags.get("device") is not None:
        recipe["device"] = flags["device"]
    pipeline = Pipeline.from_dict(recipe, source="command-line flags")
    report = workflow.optimize(loaded, pipeline, out_dir, force=force, evaluation=evaluation,
                               resume=bool(flags.get("resume")), teacher=teacher, save_pt=save_pt,
                               on_pass=lambda i, n, name: console.print(f"[{i + 1}/{n}] running {name}"))
    if is_main_process():
        print_report(report, Console())
        details = report["passes"][-1].get("details", {})
        if details.get("val_accuracy") is not None:
            click.echo(f"Best validation accuracy {details['val_accuracy']:.2%} (epoch {details['best_epoch']})")
        click.echo(wrote_line(report, out_dir))
