"""The ``optkit`` command line: a thin layer over the Python API.

Heavy imports (torch) happen inside commands, so ``optkit --help`` and
``optkit passes`` answer instantly.
"""

from __future__ import annotations

import sys
import traceback

import click

from optkit import __version__
from optkit.core.errors import OptkitError


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
    from optkit.core.registry import describe_passes

    descriptions = describe_passes(pattern)
    if not descriptions:
        raise OptkitError(f"no pass matches {pattern!r}")
    width = max(map(len, descriptions))
    for name, description in descriptions.items():
        click.echo(f"{name:<{width}}  {description}")


def _register_commands() -> None:
    # Each command lives in its own module under optkit/cli/; importing them is cheap (no torch).
    from optkit.cli.bench import bench_command
    from optkit.cli.export import export_command
    from optkit.cli.finetune import finetune_command
    from optkit.cli.inspect import inspect_command
    from optkit.cli.optimize import optimize_command
    from optkit.cli.sensitivity import sensitivity_command

    main.add_command(optimize_command)
    main.add_command(finetune_command)
    main.add_command(export_command)
    main.add_command(inspect_command)
    main.add_command(bench_command)
    main.add_command(sensitivity_command)


_register_commands()
