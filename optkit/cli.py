"""The ``optkit`` command line: a thin layer over the Python API.

Heavy imports (torch) happen inside commands, so ``optkit --help`` and
``optkit passes`` answer instantly.
"""

from __future__ import annotations

import math
import sys
import traceback

import click

from optkit import __version__
from optkit.errors import OptkitError


class OptkitGroup(click.Group):
    """Turns optkit errors into one ``Error: ...`` line and exit code 1 (a traceback only with ``--debug``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("Error: interrupted; no output was written", err=True)
            sys.exit(130)
        except Exception as e:
            if ctx.meta.get("optkit.debug"):
                traceback.print_exc()
            message = str(e) if isinstance(e, OptkitError) else f"unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback)"
            click.echo(f"Error: {' '.join(message.split())}", err=True)
            sys.exit(1)


def parse_ratio(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Click callback: a pruning ratio in [0, 1)."""
    if value is None:
        return None
    if math.isnan(value) or not 0.0 <= value < 1.0:
        raise click.BadParameter(f"must be in [0, 1), got {value}")
    return value


def parse_shape(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """Click callback: ``1,3,224,224`` -> ``(1, 3, 224, 224)``."""
    if value is None:
        return None
    try:
        shape = tuple(int(v) for v in value.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not 2 <= len(shape) <= 5 or any(v <= 0 for v in shape):
        raise click.BadParameter(f"expected 2 to 5 positive integers like 1,3,224,224, got {value!r}")
    return shape


@click.group(cls=OptkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="optkit")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """optkit: make a trained PyTorch model smaller and faster, and report what changed."""
    ctx.meta["optkit.debug"] = debug


@main.command("passes")
@click.argument("pattern", default="*")
def passes_command(pattern: str) -> None:
    """List registered passes (optionally filtered by an fnmatch PATTERN)."""
    from optkit.passes._registry import describe_passes

    descriptions = describe_passes(pattern)
    if not descriptions:
        raise OptkitError(f"no pass matches {pattern!r}")
    width = max(map(len, descriptions))
    for name, description in descriptions.items():
        click.echo(f"{name:<{width}}  {description}")


@main.command("optimize")
@click.argument("model")
@click.option("--prune", "ratio", type=float, callback=parse_ratio,
              help="Fraction to prune, in [0, 1): channels (structured) or weights (unstructured).")
@click.option("--method", type=click.Choice(["structured", "unstructured"]), default="structured", show_default=True,
              help="Structured removes channels (faster); unstructured zeroes weights (sparser, not faster).")
@click.option("--global", "global_", is_flag=True, help="Rank across all layers instead of per layer.")
@click.option("--round-to", type=click.IntRange(min=1), default=8, show_default=True,
              help="Structured: keep channel counts multiples of this.")
@click.option("--importance", type=click.Choice(["l1", "l2", "bn_scale", "random"]), default="l1", show_default=True,
              help="Structured: how channels are ranked.")
@click.option("--input-shape", callback=parse_shape, help="Example input shape, e.g. 1,3,224,224.")
@click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture.")
@click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME or package.module:Class.")
@click.option("--trust", is_flag=True, help="Allow full unpickling (runs code from the file): only for files you trust.")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False),
              help="Run the passes of this TOML recipe instead of building them from flags.")
@click.option("--out", "out_dir", default="optkit-out", show_default=True, type=click.Path(file_okay=False),
              help="Output folder for model.pt, recipe.toml, report.json and report.md.")
@click.option("--force", is_flag=True, help="Overwrite results already in the output folder.")
def optimize_command(model: str, ratio, method, global_, round_to, importance, input_shape, num_classes, arch, trust,
                     recipe_path, out_dir, force) -> None:
    """Slim MODEL (torchvision:NAME or a checkpoint file) and write the result and a report.

    Example: optkit optimize torchvision:resnet18 --prune 0.3 --out runs/demo
    """
    from rich.console import Console

    from optkit import models, workflow
    from optkit.report import print_report

    console = Console(stderr=True)
    pipeline = _pipeline_from_options(recipe_path, ratio, method, global_, round_to, importance, input_shape, model)
    with console.status(f"loading {model}"):
        loaded = models.load(model, arch=arch, num_classes=num_classes, trust=trust)

    def on_pass(index: int, total: int, name: str) -> None:
        console.print(f"[{index + 1}/{total}] running {name}")

    report = workflow.optimize(loaded, pipeline, out_dir, force=force, on_pass=on_pass)
    print_report(report, Console())
    click.echo(f"Wrote {', '.join(workflow.OUTPUT_FILES)} to {out_dir}")


def _pipeline_from_options(recipe_path, ratio, method, global_, round_to, importance, input_shape, model):
    from optkit.models import default_input_shape
    from optkit.passes.prune import L1Unstructured, StructuredPrune
    from optkit.pipeline import Pipeline

    if recipe_path is not None:
        if ratio is not None:
            raise click.UsageError("give either --recipe or --prune, not both")
        pipeline = Pipeline.load(recipe_path)
        if input_shape is not None:
            pipeline.input_shape = input_shape
        return pipeline
    if ratio is None:
        raise click.UsageError("nothing to do: give --prune RATIO or --recipe FILE")
    if method == "structured":
        pass_ = StructuredPrune(ratio=ratio, round_to=round_to, importance=importance, global_=global_)
    else:
        pass_ = L1Unstructured(ratio=ratio, global_=global_)
    return Pipeline([pass_], input_shape=input_shape or default_input_shape(model))
