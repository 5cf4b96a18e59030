"""Generate docs/cli.md from the click commands, so the CLI reference cannot drift.

Run ``python docs/gen_cli.py`` after changing a command or option;
``tests/test_docs.py`` fails while the committed file differs from what this
prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

HEADER = """# CLI reference

Every command's `--help`, generated from the click commands by
`python docs/gen_cli.py` (the tests fail when this page is out of date).
Errors print one line, `Error: ...`, and exit with status 1; add `--debug`
before the command (`optkit --debug optimize ...`) for the full traceback.
"""

#: The help text width of an 80-column terminal.
WIDTH = 78


def command_help(command: click.Command, path: list[str], parent: click.Context | None) -> tuple[str, click.Context]:
    """The ``--help`` text of ``command`` as ``optkit ... --help`` prints it, and its context."""
    ctx = click.Context(command, info_name=path[-1], parent=parent, terminal_width=WIDTH, **command.context_settings)
    return command.get_help(ctx), ctx


def generate() -> str:
    """The whole reference page as Markdown."""
    from optkit.cli import main

    sections = [HEADER]

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        text, ctx = command_help(command, path, parent)
        sections.append(f"## {' '.join(path)}\n\n```text\n{text}\n```\n")
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), path + [name], ctx)

    walk(main, ["optkit"], None)
    return "\n".join(sections)


def main() -> None:
    target = Path(__file__).with_name("cli.md")
    target.write_text(generate(), encoding="utf-8")
    print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
