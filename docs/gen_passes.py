"""Generate docs/passes.md, the settings reference of every built-in pass, from the passes' declarations.

Run ``python docs/gen_passes.py`` after changing a pass's settings;
``tests/test_docs.py`` fails while the committed page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

HEADER = """# Pass reference

Every built-in pass and its settings, generated from the settings'
declarations by `python docs/gen_passes.py` (the tests fail when this page is
out of date). The recipe key is the setting's name (`global_` is written
`global`); the CLI flag, where there is one, is an option of `optkit optimize`.
Any pass also runs with `--pass NAME:key=value,...`. Settings marked *run
option* are given at run time and never written to recipes; `input_shape` and
`device` are filled in from the pipeline when unset.
"""


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def pass_section(cls: type) -> str:
    """The Markdown section of one pass class."""
    from optkit.core.settings import SHARED_SETTINGS, declared, describe

    doc = (cls.__doc__ or "").strip().split("\n\nArgs:")[0]
    summary, _, rest = doc.partition("\n")
    switch = f" Added by `--{cls.flag}`." if cls.flag else ""
    variant = f" Chosen by `--{cls.variant[0]} {cls.variant[1]}`." if cls.variant else ""
    lines = [f"## {cls.name}", "", f"{summary.strip()}{switch}{variant}", ""]
    if rest.strip():
        lines += [" ".join(rest.split()), ""]
    rows = []
    for f in dataclasses.fields(cls):
        spec = declared(f)
        if spec is None:
            continue
        key = f.name.rstrip("_")
        default = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING else (
            "unset" if f.default is None else f"`{f.default!r}`" if f.default is not dataclasses.MISSING else
            f"`{f.default_factory()!r}`")
        shared = f.name in SHARED_SETTINGS and not spec.enables
        flag = "pipeline" if shared else f"`--{spec.flag}`" if spec.flag else ""
        kind = "run option" if not spec.recipe else describe(spec, f.type)
        rows.append(f"| `{key}` | {_cell(kind)} | {default} | {flag} | {_cell(spec.help)} |")
    if rows:
        lines += ["| setting | accepts | default | CLI | what it does |", "|---|---|---|---|---|", *rows, ""]
    else:
        lines += ["No settings.", ""]
    return "\n".join(lines)


def generate() -> str:
    """The whole reference page as Markdown."""
    from optkit.core.registry import builtin_passes, get_pass

    return "\n".join([HEADER, *(pass_section(get_pass(name)) for name in builtin_passes())])


def main() -> None:
    target = Path(__file__).with_name("passes.md")
    target.write_text(generate(), encoding="utf-8")
    print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
