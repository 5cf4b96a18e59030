"""Options every command that loads a model shares, declared once."""

from __future__ import annotations

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


def model_options(input_shape_help: str = "Example input shape, e.g. 1,3,224,224.") -> Callable:
    """``--input-shape``, ``--num-classes``, ``--arch`` and ``--trust``: how a MODEL argument is read."""
    options = [
        click.option("--input-shape", callback=parse_shape, help=input_shape_help),
        click.option("--num-classes", type=click.IntRange(min=1), help="Classifier size when building an architecture."),
        click.option("--arch", help="Architecture of a state_dict file: torchvision:NAME or package.module:Class."),
        click.option("--trust", is_flag=True,
                     help="Allow full unpickling (runs code from the file): only for files you trust."),
    ]
    return with_options(options)
