"""No documented command goes untested: each runs, or names the test that runs it (#31, #42).

Every line of README.md and docs/ outside a ``docs-test: skip`` block runs in
tests/docs/test_every_line.py, in reading order (a docs page's unmarked blocks
also run page by page in tests/test_docs.py). A new optkit, make or torchrun
line in a skipped block fails :func:`test_every_documented_line_is_run_or_covered`
until it is listed in :data:`doclines.COVERED_ELSEWHERE` with the test that runs it.
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess

import pytest

from doclines import COVERED_ELSEWHERE, ROOT, demo_command, documented_lines


def _test_exists(node_id: str) -> bool:
    path, _, name = node_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def how_it_runs(line) -> str:
    """Where a documented line runs, or ``""`` when nothing runs it."""
    if line.command in COVERED_ELSEWHERE:
        return COVERED_ELSEWHERE[line.command][0]
    if line.skipped:
        return ""
    if line.page != "README.md" and not line.cheap and line.words[0] == "optkit":
        return "tests/test_docs.py::test_code_blocks_run"
    return "tests/docs/test_every_line.py::test_every_line_runs_in_document_order"


def test_every_documented_line_is_run_or_covered():
    lines = documented_lines()
    assert len(lines) >= 50, "the extractor found too few documented lines; did the fence format change?"
    unrun = [f"{line.where}: {line.command}" for line in lines if not how_it_runs(line)]
    assert not unrun, ("these documented lines run nowhere; make them runnable or add them to "
                       "tests/docs/doclines.py COVERED_ELSEWHERE with the test that runs them:\n" + "\n".join(unrun))


def test_lines_covered_elsewhere_are_documented_and_their_tests_exist():
    commands = {line.command for line in documented_lines()}
    stale = [command for command in COVERED_ELSEWHERE if command not in commands]
    assert not stale, f"COVERED_ELSEWHERE lists commands no page documents any more: {stale}"
    missing = [node for nodes in COVERED_ELSEWHERE.values() for node in nodes if not _test_exists(node)]
    assert not missing, f"COVERED_ELSEWHERE names tests that do not exist: {missing}"


def test_a_page_that_quotes_the_demo_command_quotes_the_makefiles():
    """getting-started.md shows what `make demo` runs; it is the Makefile's command, which the cheap run runs."""
    demo = shlex.join(demo_command())
    quoted = [line for line in documented_lines() if "--out runs/demo" in line.command and line.words[0] == "optkit"]
    assert quoted and all(line.command == demo for line in quoted), (
        f"{[line.where for line in quoted]}: the docs' demo command differs from the Makefile's {demo!r}")


def test_make_test_runs_the_test_command():
    """`make test` (README, getting-started.md) runs pytest as configured: what .ci/run and these tests run."""
    # Under `make test` itself (CI), the inherited MAKEFLAGS/MAKELEVEL would add "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1] == ".venv/bin/python -m pytest"


@pytest.mark.parametrize("line", [line for line in documented_lines() if line.words[0] == "make"],
                         ids=lambda line: f"{line.where}:{line.command}")
def test_make_lines_name_targets_of_the_makefile(line):
    targets = subprocess.run(["make", "-qp"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert f"\n{line.words[1]}:" in targets, f"{line.where}: `{line.command}`: the Makefile has no such target"
