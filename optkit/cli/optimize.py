"""``optkit optimize``: build a pipeline from flags or a recipe, run it, write the results.

Flags build the same structure as a recipe file (a list of ``[[pass]]``
tables), which goes through the same strict validation, and every run writes
the recipe it ran.
"""

from __future__ import annotations

from typing import Any

import click

from optkit.cli._options import parse_device, parse_ratio, parse_shape, parse_workers
from optkit.cli.finetune import (
    data_input_shape,
    finetune_settings,
    show_epoch_lines,
    training_options,
    with_run_options,
)


def parse_fraction(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Click callback: a target fraction of the original, in (0, 1)."""
    if value is None:
        return None
    if not 0.0 < value < 1.0:
        raise click.BadParameter(f"must be a fraction in (0, 1), e.g. 0.5; got {value}")
    return value


@click.command("optimize")
@click.argument("model")
@click.option("--prune", "ratio", type=float, callback=parse_ratio,
              help="Fraction to prune, in [0, 1): channels (structured) or weights (unstructured).")
@click.option("--method", type=click.Choice(["structured", "unstructured"]), default="structured", show_default=True,
              help="Structured removes channels (faster); unstructured zeroes weights (sparser, not faster).")
@click.option("--global", "global_", is_flag=True, help="Rank across all layers instead of per layer.")
@click.option("--round-to", type=click.IntRange(min=1), default=8, show_default=True,
              help="Structured: keep channel counts multiples of this.")
@click.option("--importance", type=click.Choice(["l1", "l2", "taylor", "bn_scale", "random"]), default="l1",
              show_default=True, help="Structured: how channels are ranked (taylor needs --calib-data).")
@click.option("--target-macs", type=float, callback=parse_fraction,
              help="Structured: prune until MACs are this fraction of the original, e.g. 0.5 (instead of --prune).")
@click.option("--target-params", type=float, callback=parse_fraction,
              help="Structured: prune until parameters are this fraction of the original (instead of --prune).")
@click.option("--device", callback=parse_device, metavar="auto|cpu|cuda|cuda:N|mps",
              help="Move the model to this device first (auto: CUDA, then MPS, then CPU).")
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]),
              help="Wrap the result in autocast: fp16 on GPUs; auto picks bf16 on a CPU only where it measures faster.")
@click.option("--channels-last", is_flag=True, help="Store conv weights channels-last (NHWC).")
@click.option("--workers", callback=parse_workers, metavar="auto|N",
              help="DataLoader workers for passes that load data (auto: chosen by measurement).")
@click.option("--insert-bn", is_flag=True,
              help="Insert a function-preserving BatchNorm after every conv without a norm layer (first pass).")
@click.option("--recalibrate-bn", type=click.IntRange(min=1), metavar="N",
              help="Re-estimate BatchNorm statistics from N batches of --calib-data (after pruning).")
@click.option("--calib-data", metavar="SPEC",
              help="Dataset spec (fashion-mnist, imagefolder:DIR, ...) for --recalibrate-bn, --insert-bn and --importance taylor.")
@click.option("--fold-bn", is_flag=True, help="Fold BatchNorms into the preceding conv/linear layers (last pass).")
@click.option("--iterative-steps", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prune in this many steps (compounding to --prune or the target); with --finetune, fine-tune after each.")
@click.option("--finetune", "finetune_data", metavar="SPEC",
              help="Fine-tune after pruning on this dataset (fashion-mnist, imagefolder:DIR, ...); see the training flags.")
@training_options
@click.option("--input-shape", callback=parse_shape, help="Example input shape, e.g. 1,3,224,224.")
@click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture.")
@click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME or package.module:Class.")
@click.option("--trust", is_flag=True, help="Allow full unpickling (runs code from the file): only for files you trust.")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False),
              help="Run the passes of this TOML recipe instead of building them from flags.")
@click.option("--out", "out_dir", default="optkit-out", show_default=True, type=click.Path(file_okay=False),
              help="Output folder for model.pt, recipe.toml, report.json and report.md.")
@click.option("--force", is_flag=True, help="Overwrite results already in the output folder.")
@click.option("--export", "export_format", type=click.Choice(["onnx"]),
              help="Also write model.onnx, verified against PyTorch in ONNX Runtime.")
@click.option("--latency", is_flag=True, help="Also time the model before and after (PyTorch eager) for the report.")
def optimize_command(model: str, input_shape, num_classes, arch, trust, recipe_path, out_dir, force, export_format,
                     latency,
                     **flags: Any) -> None:
    """Slim MODEL (torchvision:NAME or a checkpoint file) and write the result and a report.

    Example: optkit optimize torchvision:resnet18 --prune 0.3 --out runs/demo
    """
    from rich.console import Console

    from optkit import workflow

    from optkit.io import models
    from optkit.analysis.report import print_report
    from optkit.passes.finetune.loop import init_distributed, is_main_process

    console = Console(stderr=True)
    pipeline = _pipeline(model, recipe_path, input_shape, flags)
    init_distributed()
    show_epoch_lines()
    with console.status(f"loading {model}"):
        loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)
    if input_shape is None and recipe_path is None and flags.get("finetune_data"):
        pipeline.input_shape = data_input_shape(loaded.model, flags["finetune_data"])
    with_run_options(pipeline, out_dir, resume=flags.get("resume", False))

    def on_pass(index: int, total: int, name: str) -> None:
        console.print(f"[{index + 1}/{total}] running {name}")

    report = workflow.optimize(loaded, pipeline, out_dir, force=force, on_pass=on_pass, export=export_format,
                               latency=latency)
    if is_main_process():
        print_report(report, Console())
        plot = ", channels.png" if report.get("layers") else ""
        click.echo(f"Wrote {', '.join(report['files'])}, recipe.toml, report.json, report.md{plot} to {out_dir}")


def _pipeline(model: str, recipe_path: str | None, input_shape, flags: dict[str, Any]):
    from optkit.io.models import default_input_shape
    from optkit.core.pipeline import Pipeline

    entries = pass_entries_from_flags(flags)
    if recipe_path is not None:
        if entries:
            raise click.UsageError("give either --recipe or pass flags such as --prune, not both")
        pipeline = Pipeline.load(recipe_path)
        if input_shape is not None:
            pipeline.input_shape = input_shape
        return pipeline
    if not entries:
        raise click.UsageError("nothing to do: give --prune RATIO, --target-macs FRACTION, --finetune SPEC (or another pass flag) "
                               "or --recipe FILE")
    data = {"input_shape": list(input_shape or default_input_shape(model)), "pass": entries}
    return Pipeline.from_dict(data, source="command-line flags")


def pass_entries_from_flags(flags: dict[str, Any]) -> list[dict[str, Any]]:
    """Recipe ``[[pass]]`` entries for the pass flags given, in pipeline order."""
    entries: list[dict[str, Any]] = []
    if flags.get("device") is not None:
        entries.append({"name": "to_device", "device": flags["device"]})
    calib_data = flags.get("calib_data")
    targets = {key: flags[key] for key in ("target_macs", "target_params") if flags.get(key) is not None}
    if len(targets) > 1:
        raise click.UsageError("give --target-macs or --target-params, not both")
    if targets and (flags["ratio"] is not None or flags["method"] != "structured"):
        raise click.UsageError("--target-macs/--target-params replace --prune and apply to structured pruning only")
    taylor = flags.get("importance") == "taylor"
    if taylor and calib_data is None:
        raise click.UsageError("--importance taylor needs data: add --calib-data SPEC (e.g. fashion-mnist)")
    if flags.get("recalibrate_bn") is not None and calib_data is None:
        raise click.UsageError("--recalibrate-bn needs data: add --calib-data SPEC (e.g. fashion-mnist)")
    if calib_data is not None and not (flags.get("insert_bn") or flags.get("recalibrate_bn") is not None or taylor):
        raise click.UsageError("--calib-data is used only by --insert-bn, --recalibrate-bn and --importance taylor")
    if flags.get("insert_bn"):
        entries.append({"name": "insert_batchnorm", **({"data": calib_data} if calib_data else {})})
    after_prune = []
    if flags.get("recalibrate_bn") is not None:
        after_prune.append({"name": "recalibrate_batchnorm", "data": calib_data, "batches": flags["recalibrate_bn"]})
    if flags.get("finetune_data"):
        finetune = {"name": "finetune", "data": flags["finetune_data"], **finetune_settings(flags)}
        if flags.get("device") not in (None, "auto"):
            finetune["device"] = flags["device"]
        after_prune.append(finetune)
    steps = flags.get("iterative_steps", 1)
    if flags["ratio"] is not None and steps > 1 and flags.get("finetune_data"):
        # Each step removes the same fraction of what is left, so the steps compound to the total.
        step_ratio = 1.0 - (1.0 - flags["ratio"]) ** (1.0 / steps)
        for _ in range(steps):
            entries += [_prune_entry(flags, step_ratio), *(dict(e) for e in after_prune)]
    else:
        if flags["ratio"] is not None or targets:
            entry = _prune_entry(flags, flags["ratio"], targets)
            if steps > 1 and entry["name"] == "structured_prune":
                entry["iterative_steps"] = steps
            entries.append(entry)
        entries += after_prune
    if flags.get("fold_bn"):
        entries.append({"name": "fold_batchnorm"})
    if flags.get("channels_last"):
        entries.append({"name": "channels_last"})
    if flags.get("amp") not in (None, "off"):
        entries.append({"name": "autocast", "dtype": flags["amp"]})
    if flags.get("workers") is not None:
        _set_data_workers(entries, flags["workers"])
    return entries


def _prune_entry(flags: dict[str, Any], ratio: float | None, targets: dict[str, float] | None = None) -> dict[str, Any]:
    if flags["method"] != "structured":
        return {"name": "l1_unstructured", "ratio": ratio, "global": flags["global_"]}
    entry = {"name": "structured_prune", "round_to": flags["round_to"], "importance": flags["importance"],
             "global": flags["global_"], **(targets or {})}
    if ratio is not None:
        entry["ratio"] = ratio
    if flags["importance"] == "taylor":
        entry["data"] = flags["calib_data"]
    return entry


def _set_data_workers(entries: list[dict[str, Any]], workers: int | str) -> None:
    """Give ``--workers`` to every pass that loads data (has a ``num_workers`` setting)."""
    import dataclasses

    from optkit.passes import get_pass

    for entry in entries:
        if any(f.name == "num_workers" for f in dataclasses.fields(get_pass(entry["name"]))):
            entry.setdefault("num_workers", workers)
