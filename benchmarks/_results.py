"""Where a benchmark writes: the committed ``benchmarks/results/`` for a full run, elsewhere for a cheap one.

A run with fewer models, fewer repeats or a quick mode measures less than the
run whose tables are committed; writing its partial table over them would
lose the full one. Each script names the options that make a run partial
(:func:`partial_options`), and :func:`destination` sends such a run's files to
:data:`PARTIAL` (a folder in the temporary directory) unless its ``--out``
names a place outside it, and says where they went.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: Where a partial run's files go instead of ``benchmarks/results/``.
PARTIAL = Path(tempfile.gettempdir()) / "optkit-benchmarks-partial"


def partial_options(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The options among ``names`` (argparse dests) that differ from their defaults, as ``--name value``."""
    changed = []
    for name in names:
        value = getattr(args, name)
        if value != parser.get_default(name):
            shown = value if not isinstance(value, (list, tuple)) else ",".join(map(str, value))
            changed.append(f"--{name.replace('_', '-')}" + ("" if value is True else f" {shown}"))
    return changed


def destination(path: str | Path, partial: Sequence[str], *, committed: str | Path | None = None) -> Path:
    """Where to write ``path``: itself for a full run, or a run whose ``path`` is not a committed result;
    the same name under :data:`PARTIAL` for a partial run whose ``path`` is in ``benchmarks/results/``.

    Args:
        path: where the script would write (a file, a folder, or a path without extension).
        partial: what makes the run partial (:func:`partial_options`); empty for a full run.
        committed: a committed path outside ``benchmarks/results/`` that a partial run must not overwrite either
            (the shipped language model that ``train_lm.py`` writes).
    """
    path = Path(path)
    guarded = [RESULTS.resolve()] + ([Path(committed).resolve()] if committed is not None else [])
    resolved = path.resolve()
    for root in guarded:
        if partial and (resolved == root or root in resolved.parents):
            moved = PARTIAL / root.name / resolved.relative_to(root)
            shown = resolved.relative_to(ROOT) if ROOT in resolved.parents else path
            print(f"a partial run ({', '.join(partial)}): writing {moved} instead of {shown}, whose committed "
                  "figures are the full run's", file=sys.stderr, flush=True)
            moved.parent.mkdir(parents=True, exist_ok=True)
            return moved
    return path


def pinned(package: str) -> str | None:
    """The version ``pyproject.toml`` pins ``package`` to (``name==X``), or ``None``."""
    import re

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(rf'"{re.escape(package)}==([^"]+)"', text)
    return match[1] if match else None


def pin_note(package: str, recorded: str | None) -> str | None:
    """A sentence for a results file recorded with another version of ``package`` than the one now pinned,
    e.g. ``"Recorded with torch-pruning 1.6.0; pyproject.toml now pins 1.6.1, with which these figures were not
    measured again."``; ``None`` when they agree."""
    pin = pinned(package)
    if recorded is None or pin is None or recorded == pin:
        return None
    return (f"Recorded with {package} {recorded}; pyproject.toml now pins {pin}, with which these figures were not "
            "measured again.")


def pin_lines(package: str, recorded: str | None) -> list[str]:
    """:func:`pin_note` as Markdown lines (the sentence and a blank line), or none."""
    note = pin_note(package, recorded)
    return [note, ""] if note else []
