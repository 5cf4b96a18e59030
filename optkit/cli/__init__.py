"""The ``optkit`` command line: a thin layer over the Python API.

Heavy imports (torch) happen inside commands, so ``optkit --help`` and
``optkit passes`` answer instantly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

import click

from optkit import __version__
from optkit.core.errors import OptkitError


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is so that it unwinds as on Ctrl-C: staging and scratch folders are
    removed, nothing half-written is left."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a command runs, SIGTERM raises :class:`Terminated` (when SIGTERM has its default action and this is
    the main thread; a handler someone else installed is left alone). A forked child (a data loader's worker)
    that inherits the handler dies of SIGTERM as before."""
    owner = os.getpid()

    def terminated(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    install = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if install:
        signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class OptkitGroup(click.Group):
    """Turns optkit errors into one ``Error: ...`` line and exit code 1 (a traceback only with ``--debug``);
    Ctrl-C (exit code 130) and SIGTERM (143) unwind the command, so it leaves no output or scratch behind."""

    def invoke(self, ctx: click.Context):
        try:
            with _sigterm_unwinds():
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt as e:
            terminated = isinstance(e, Terminated)
            click.echo(f"Error: {'terminated' if terminated else 'interrupted'}; no output was written", err=True)
            sys.exit(128 + signal.SIGTERM if terminated else 130)
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
