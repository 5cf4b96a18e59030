"""Options every command that loads a model shares, declared once."""

from __future__ import annotations

import functools
from collections.abc import Callable

import click

from optkit.cli.generated import with_options


def parse_shape(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """Click callback: ``1,3,224,224`` -> ``(1, 3, 224, 224)``."""
    from optkit.core.settings import check_input_shape

    if value is None:
        return None
    try:
        return check_input_shape([int(v) for v in value.replace("x", ",").split(",")])
    except ValueError:
        raise click.BadParameter(f"expected 2 to 5 positive integers like 1,3,224,224, got {value!r}") from None


def output_options(what: str = "the result, recipe.toml, report.json and report.md") -> Callable:
    """Where and how a command writes its results: ``--out``, ``--force``, ``--save-pt``.

    A Hugging Face model whose stock class describes the result is written once, as a ``save_pretrained``
    folder; ``--save-pt`` also writes ``model.pt`` (the slimmed checkpoint), which every other model gets anyway.
    """
    return with_options([
        click.option("--out", "out_dir", default="optkit-out", show_default=True, type=click.Path(file_okay=False),
                     help=f"Output folder for {what}."),
        click.option("--force", is_flag=True, help="Overwrite results already in the output folder."),
        click.option("--save-pt", is_flag=True,
                     help="Also write model.pt (the slimmed checkpoint) when the result is a save_pretrained folder "
                          "(a Hugging Face model its stock class describes); other models always get model.pt."),
    ])


def model_options(input_shape_help: str = "Example input shape, e.g. 1,3,224,224.") -> Callable:
    """How a MODEL argument is read: ``--input-shape``, ``--seq-len``, ``--kind``, ``--num-classes``, ``--arch``,
    ``--trust``, ``--random-weights``.

    ``--seq-len L`` is the token-model form of ``--input-shape 1,L``; ``--kind`` names the
    model's kind and ``--random-weights`` allows a Hugging Face folder without weights, for every model the
    command loads. The command receives none of the three: it gets ``input_shape`` and loads with
    :func:`optkit.io.models.load` as usual. The ``--kind`` help lists
    optkit's own kinds from the kind registry.
    """
    from optkit.kinds import builtin_kinds

    options = [
        click.option("--input-shape", callback=parse_shape, help=input_shape_help),
        click.option("--seq-len", type=click.IntRange(min=1),
                     help="Token models: sequence length of the example inputs (the same as --input-shape 1,L)."),
        click.option("--kind", help=f"Model kind when it cannot be told from the model: {', '.join(builtin_kinds())} "
                                    "(or one a plugin registers)."),
        click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture."),
        click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME, timm:NAME or "
                                    "package.module:Class."),
        click.option("--trust", is_flag=True,
                     help="Allow full unpickling (runs code from the file): only for files you trust."),
        click.option("--random-weights", is_flag=True,
                     help="Build a Hugging Face folder that holds config.json and no weights with random weights "
                          "(refused otherwise: its results would mean nothing)."),
    ]
    add_options = with_options(options)

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def run(*args, seq_len: int | None = None, kind: str | None = None, random_weights: bool = False, **kwargs):
            from optkit.core.errors import OptkitError
            from optkit.io.models import random_weights_allowed, requested_kind
            from optkit.kinds import get_kind

            if seq_len is not None:
                if kwargs.get("input_shape") is not None:
                    raise click.UsageError("give --seq-len or --input-shape, not both")
                kwargs["input_shape"] = (1, seq_len)
            if kind is not None:
                try:
                    get_kind(kind)
                except OptkitError as e:
                    raise click.BadParameter(str(e), param_hint="--kind") from None
            with requested_kind(kind), random_weights_allowed(random_weights):
                return command(*args, **kwargs)

        return add_options(run)

    return decorate


def eval_options() -> Callable:
    """``--eval SPEC`` and its options, generated from :class:`optkit.analysis.evaluation.EvalSettings`."""
    from optkit.analysis.evaluation import EvalSettings
    from optkit.cli.generated import setting_option, settings_flags

    return with_options([setting_option(flag) for flag in settings_flags(EvalSettings).values()])


def eval_settings(flags: dict):
    """The :class:`EvalSettings` the ``--eval`` options give (``None`` without ``--eval``); pops their values.

    Raises:
        click.UsageError: for ``--eval-samples`` or ``--eval-batch-size`` without ``--eval``.
    """
    from optkit.analysis.evaluation import EvalSettings
    from optkit.cli.generated import settings_flags, settings_from_flags

    eval_flags = settings_flags(EvalSettings)
    given = {flag.param: flags.pop(flag.param, None) for flag in eval_flags.values()}
    if given["eval"] is None:
        extra = [f"--{flag.name}" for flag in eval_flags.values() if given[flag.param] is not None]
        if extra:
            raise click.UsageError(f"{', '.join(extra)} set the evaluation: add --eval SPEC")
        return None
    return settings_from_flags(EvalSettings, eval_flags, given)
