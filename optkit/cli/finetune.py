"""``optkit finetune``: train a (pruned) model on a dataset to recover accuracy.

The training flags here are shared with ``optkit optimize --finetune SPEC``.
Both commands run the same way under ``torchrun --nproc_per_node=N -m optkit ...``
(DistributedDataParallel; only rank 0 writes files).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from optkit.cli._options import parse_shape, parse_workers

#: The ``finetune`` pass settings the training flags set (flag name -> pass setting).
TRAINING_SETTINGS = ("epochs", "batch_size", "lr", "weight_decay", "warmup", "grad_clip", "distill",
                     "temperature", "alpha", "seed", "checkpoint_every")


def training_options(command):
    """Click options for fine-tuning shared by ``finetune`` and ``optimize``."""
    options = [
        click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True,
                     help="Fine-tune: passes over the training split."),
        click.option("--batch-size", type=click.IntRange(min=1), default=128, show_default=True,
                     help="Fine-tune: samples per step on each process."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
                     help="Fine-tune: peak AdamW learning rate (cosine schedule after warmup)."),
        click.option("--weight-decay", type=click.FloatRange(min=0), default=0.05, show_default=True,
                     help="Fine-tune: AdamW weight decay (not applied to biases and norm parameters)."),
        click.option("--warmup", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
                     help="Fine-tune: fraction of steps spent warming the learning rate up."),
        click.option("--grad-clip", type=click.FloatRange(min=0), default=1.0, show_default=True,
                     help="Fine-tune: clip the gradient norm to this (0 disables)."),
        click.option("--train-amp", type=click.Choice(["auto", "off", "bf16", "fp16"]), default="auto",
                     show_default=True,
                     help="Fine-tune: autocast while training; auto is bf16/fp16 on CUDA and off on CPU."),
        click.option("--distill", is_flag=True,
                     help="Fine-tune: also learn from the model before pruning (knowledge distillation)."),
        click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
                     help="Distillation: softening temperature."),
        click.option("--alpha", type=click.FloatRange(0, 1), default=0.5, show_default=True,
                     help="Distillation: weight of the teacher term (the label loss gets 1 - alpha)."),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Fine-tune: seed for data order and training randomness."),
        click.option("--checkpoint-every", type=click.IntRange(min=0), default=200, show_default=True,
                     help="Fine-tune: checkpoint every N steps as well as at each epoch end (0: epoch ends only)."),
        click.option("--resume", is_flag=True,
                     help="Fine-tune: continue from the checkpoint in --out after an interruption."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def show_epoch_lines() -> None:
    """Print each epoch's summary on stderr when there is no progress bar (not a terminal, other ranks)."""
    import logging

    logger = logging.getLogger("optkit.passes.finetune.loop")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def finetune_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """The ``finetune`` recipe settings given by the training flags (``--workers`` is handled by the caller)."""
    return {**{key: flags[key] for key in TRAINING_SETTINGS}, "amp": flags["train_amp"]}


def data_input_shape(model, data: str) -> tuple[int, int, int, int]:
    """The training input shape when none is given: the dataset's image size, the model's input channels.

    The channels come from the model's first convolution (so a torchvision model
    gets 3 and Fashion-MNIST's grayscale is repeated); without one, the dataset's.
    """
    from torch import nn

    from optkit.data.datasets import dataset_info

    info = dataset_info(data)
    first_conv = next((m for m in model.modules() if isinstance(m, (nn.Conv2d,))), None)
    channels = first_conv.in_channels if first_conv is not None else info.channels
    return (1, channels, *info.image_size)


def with_run_options(pipeline, out_dir: str, *, resume: bool, teacher=None):
    """Give the pipeline's ``finetune`` passes checkpoint files in ``out_dir``, ``resume`` and a teacher."""
    stages = [i for i, p in enumerate(pipeline.passes) if p.name == "finetune"]
    for number, index in enumerate(stages, start=1):
        p = pipeline.passes[index]
        name = "finetune.ckpt" if len(stages) == 1 else f"finetune-{number}.ckpt"
        changes = {"resume": resume, "checkpoint": p.checkpoint or str(Path(out_dir) / name)}
        if teacher is not None:
            changes["teacher"] = teacher
        pipeline.passes[index] = dataclasses.replace(p, **changes)
    return pipeline


@click.command("finetune")
@click.argument("model")
@click.option("--data", required=True,
              help="Dataset spec: fashion-mnist[:DIR], imagefolder:DIR, mnist:DIR, cifar10:DIR, synthetic:N[:CxHxW[:K]].")
@training_options
@click.option("--teacher", "teacher_spec",
              help="Model to distil from with --distill (e.g. the model before pruning).")
@click.option("--input-shape", callback=parse_shape,
              help="Model input, e.g. 1,3,28,28; samples are repeated to its channels and resized to its size. "
                   "Default: the data's image size with the model's input channels.")
@click.option("--device", help="Training device (cpu, cuda, cuda:1); default CUDA when available.")
@click.option("--workers", callback=parse_workers, metavar="auto|N",
              help="DataLoader workers (auto: chosen by measurement).")
@click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture.")
@click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME or package.module:Class.")
@click.option("--trust", is_flag=True, help="Allow full unpickling (runs code from the file): only for files you trust.")
@click.option("--out", "out_dir", default="optkit-out", show_default=True, type=click.Path(file_okay=False),
              help="Output folder for model.pt, recipe.toml, report.json, report.md and finetune.ckpt.")
@click.option("--force", is_flag=True, help="Overwrite results already in the output folder.")
def finetune_command(model: str, data: str, teacher_spec, input_shape, device, workers, num_classes, arch, trust,
                     out_dir, force, **flags: Any) -> None:
    """Fine-tune MODEL on --data and write the trained model and a report.

    Example: optkit finetune runs/pruned/model.pt --data fashion-mnist --epochs 2 --distill --teacher base.pt
    """
    from rich.console import Console

    from optkit import workflow

    from optkit.io import models
    from optkit.core.pipeline import Pipeline
    from optkit.analysis.report import print_report
    from optkit.passes.finetune.loop import init_distributed, is_main_process

    if flags["distill"] and teacher_spec is None:
        raise click.UsageError("--distill needs --teacher MODEL (the model before pruning)")
    init_distributed()
    show_epoch_lines()
    console = Console(stderr=True)
    loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    teacher = models.load_model(teacher_spec, arch=arch, num_classes=num_classes, trust=trust) if teacher_spec else None
    shape = input_shape or data_input_shape(loaded.model, data)
    entry = {"name": "finetune", "data": data, **finetune_settings(flags)}
    if device is not None:
        entry["device"] = device
    if workers is not None:
        entry["num_workers"] = workers
    pipeline = Pipeline.from_dict({"input_shape": list(shape), "pass": [entry]}, source="command-line flags")
    with_run_options(pipeline, out_dir, resume=flags["resume"], teacher=teacher)
    report = workflow.optimize(loaded, pipeline, out_dir, force=force,
                               on_pass=lambda i, n, name: console.print(f"[{i + 1}/{n}] running {name}"))
    if is_main_process():
        print_report(report, Console())
        details = report["passes"][-1].get("details", {})
        if details.get("val_accuracy") is not None:
            click.echo(f"Best validation accuracy {details['val_accuracy']:.2%} (epoch {details['best_epoch']})")
        click.echo(f"Wrote {', '.join(workflow.OUTPUT_FILES)} to {out_dir}")
