"""What the commands that run pipelines share: the built-in pass classes, the INT8 options, epoch lines."""

from __future__ import annotations


def builtin_classes() -> dict[str, type]:
    """optkit's own pass classes by name (importing them needs no torch), for generating flags."""
    from optkit.core.registry import builtin_passes, get_pass

    return {name: get_pass(name) for name in builtin_passes()}


def int8_options(flags: dict, switch_help: str) -> list:
    """``--int8`` and the INT8 settings' options (generated from :class:`Int8Settings`)."""
    import click

    from optkit.cli.generated import setting_option

    switch = click.option("--int8", is_flag=True, help=switch_help)
    return [switch, *(setting_option(flag, help_prefix="INT8: ") for flag in flags.values())]


def wrote_line(report: dict, out_dir) -> str:
    """The ``Wrote ... to OUT`` line of a run: its result files, recipe and report, the channels plot when drawn,
    and the fine-tune checkpoints (written as training goes, for ``--resume``, not with the results)."""
    from pathlib import Path

    plot = ", channels.png" if report.get("layers") else ""
    checkpoints = "".join(f", {path.name}" for path in sorted(Path(out_dir).glob("finetune*.ckpt")))
    return f"Wrote {', '.join(report['files'])}, recipe.toml, report.json, report.md{plot}{checkpoints} to {out_dir}"


def show_epoch_lines() -> None:
    """Print each epoch's summary on stderr when there is no progress bar (not a terminal, other ranks)."""
    import logging

    logger = logging.getLogger("optkit.passes.finetune")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def data_input_shape(model, data: str) -> tuple[int, int, int, int]:
    """The training input shape when none is given: the dataset's image size, the model's input channels.

    The channels come from the model's first convolution (so a torchvision model
    gets 3 and Fashion-MNIST's grayscale is repeated); without one, the dataset's.
    """
    from optkit.data import dataset_info
    from optkit.io.models import input_channels

    info = dataset_info(data)
    return (1, input_channels(model) or info.channels, *info.image_size)
