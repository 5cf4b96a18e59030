"""Click callbacks shared by several commands."""

from __future__ import annotations

import math

import click


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


def parse_workers(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    """Click callback: ``auto`` or a worker count >= 0."""
    if value is None or value == "auto":
        return value
    if not value.isdigit():
        raise click.BadParameter(f"expected 'auto' or an integer >= 0, got {value!r}")
    return int(value)


def parse_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    from optkit.core.settings import check_device

    try:
        return check_device(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
