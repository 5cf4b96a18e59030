"""Every documented line runs as written, in document order, in a fresh copy of the repository (#42).

A new user reads the README and then the guide, page after page, in one
folder. So do these tests: README.md, then the pages of ``mkdocs.yml``'s nav
(:func:`doclines.reading_order`), every block in order (how each kind of line
runs: :mod:`docrunner`). A line that needs a file nothing ships or makes
earlier, or that writes into an ``--out`` folder an earlier line filled (optkit
refuses: "already holds results"), fails.

The default run checks that statically, from the lines' words
(:func:`test_no_line_writes_where_an_earlier_line_wrote`,
:func:`test_every_file_a_line_reads_is_shipped_or_made_earlier`); the slow
tier runs every line (about 20 minutes on 2 cores: the README's lines train,
score and export at full size, the language model's allocation measures for
minutes), each page's after the pages before it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docrunner import Runner, expect_what_the_readme_says, fashion_installed, fresh_checkout, text_installed
from doclines import (PROGRAMS, ROOT, DocLine, blocks_in_order, cheap_form, make_variable, option_value,
                      reading_order, shell_lines)

#: optkit commands that write an output folder (``--out``, default ``optkit-out``), refusing one that holds results.
WRITES_FOLDER = ("optimize", "finetune", "sensitivity")
#: Dataset spec prefixes that name a path.
PATH_DATA = ("imagefolder:", "coco:", "text:")
DATA_OPTIONS = ("--data", "--calib-data", "--finetune", "--eval")
#: Quoted file and folder names in Python code (what a block or ``python -c`` writes or reads).
PY_PATH = re.compile(r"""["']((?:runs/)?[\w.-]+(?:/[\w.-]+)*\.(?:pt|pth|safetensors|onnx|xml|toml|json|py|md)|runs/[\w./-]+)["']""")


@functools.lru_cache
def shipped() -> frozenset[str]:
    """What a clone holds: every tracked file and the folders above them (outside a git checkout, every file but
    the environment's and the runs')."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode == 0:
        listed = done.stdout.decode().split("\0")
    else:
        left_out = {".git", ".venv", "runs", "__pycache__", "site"}
        listed = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                  if p.is_file() and not left_out & set(p.relative_to(ROOT).parts)]
    found = set()
    for name in filter(None, listed):
        path = Path(name)
        found |= {str(path), *(str(p) for p in path.parents if str(p) != ".")}
    return frozenset(found)


@functools.lru_cache
def value_options(command: str) -> frozenset[str]:
    """The options of ``optkit COMMAND`` that take a value."""
    from optkit.cli import main

    found = set()
    for param in main.get_command(None, command).params:
        if getattr(param, "is_flag", False) or getattr(param, "count", False) or not getattr(param, "opts", None):
            continue
        found |= {opt for opt in param.opts + param.secondary_opts if opt.startswith("-")}
    return frozenset(found)


def positionals(words: list[str]) -> list[str]:
    """The arguments of an optkit command that are not options or option values."""
    takes = value_options(words[1])
    found, skip = [], False
    for word in words[2:]:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in takes
        else:
            found.append(word)
    return found


def spec_path(spec: str) -> str | None:
    """The path a model or data spec reads, or ``None`` for one built by name (``torchvision:``, ``fashion-mnist``)."""
    if spec.startswith("hf:"):
        return spec[3:]
    if spec.startswith(PATH_DATA):
        return spec.split(":", 1)[1].split("?")[0]
    if re.match(r"^[a-z][\w-]*:", spec):
        return None
    return spec


def files_of(line: DocLine) -> tuple[list[str], list[str], list[str]]:
    """What a line reads (paths), writes (paths), and which Python modules it imports by ``--arch``."""
    words = line.words
    reads: list[str] = []
    writes: list[str] = []
    modules: list[str] = []
    program = words[0]
    if program in ("optkit", "torchrun"):
        if program == "torchrun":
            words = words[words.index("optkit"):] if "optkit" in words else words[:1]
        if len(words) < 2 or words[1] not in {"optimize", "finetune", "sensitivity", "inspect", "export", "bench"}:
            return reads, writes, modules
        command = words[1]
        reads += [p for spec in positionals(words) if (p := spec_path(spec))]
        for option in ("--recipe", "--teacher"):
            if (value := option_value(words, option)) and (p := spec_path(value)):
                reads.append(p)
        for option in DATA_OPTIONS:
            if (value := option_value(words, option)) and value.startswith(PATH_DATA):
                reads.append(spec_path(value))
        arch = option_value(words, "--arch")
        if arch and ":" in arch and not arch.startswith(("torchvision:", "timm:")):
            modules.append(arch.split(":")[0])
        if command in WRITES_FOLDER:
            writes.append(option_value(words, "--out") or "optkit-out")
        if command == "export" and (onnx := option_value(words, "--onnx")):
            writes += [onnx, str(Path(onnx).with_suffix(".xml")), str(Path(onnx).with_suffix(".bin"))]
    elif program == "make" and words[1:] == ["demo"]:
        writes.append(option_value(shlex_words(make_variable("DEMO_TRAINED")), "--out"))
    elif program in ("cat", "head", "ls"):
        reads += [w for w in words[1:] if not w.startswith("-")]
    elif program == "cp":
        reads.append(words[-2])
        writes.append(words[-1])
    elif program == "mkdir":
        writes += [w for w in words[1:] if not w.startswith("-")]
    elif program == "python":
        if words[1:2] == ["-c"]:
            writes += PY_PATH.findall(words[2])
        elif len(words) > 1:
            reads.append(words[1])
    return reads, writes, modules


def shlex_words(text: str) -> list[str]:
    import shlex

    return shlex.split(text)


def installed(module: str) -> bool:
    """Whether ``module`` imports without the current folder or the checkout on ``sys.path``."""
    top = module.split(".")[0]
    here = {"", ".", os.getcwd(), str(ROOT)}
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p not in here]
    try:
        return importlib.util.find_spec(top) is not None and top not in ("tests", "benchmarks")
    finally:
        sys.path[:] = saved


def normal(path: str) -> str:
    return os.path.normpath(path)


class Trail:
    """What earlier lines made, in reading order."""

    def __init__(self) -> None:
        self.made: dict[str, str] = {}

    def exists(self, path: str) -> bool:
        path = normal(path)
        if os.path.isabs(path):
            return os.path.exists(path)
        if path in shipped() or path in self.made:
            return True
        return any(path.startswith(made + os.sep) or made.startswith(path + os.sep) for made in self.made)

    def make(self, path: str, where: str) -> None:
        self.made.setdefault(normal(path), where)


def problems(steps: list[tuple[str, object]]) -> tuple[list[str], list[str]]:
    """``(collisions, missing)`` over blocks and lines in order: writes into a folder an earlier line filled
    (without ``--force``, or ``--resume`` of it), and reads of what nothing ships or made earlier."""
    trail, folders = Trail(), {}
    collisions, missing = [], []
    for kind, item in steps:
        if kind == "block":
            block = item
            if block.action == "write":
                trail.make(block.arg, block.where)
            elif block.lang == "python" and block.action != "skip":
                for path in PY_PATH.findall(block.body):
                    trail.make(path, block.where)
            continue
        line: DocLine = item
        reads, writes, modules = files_of(line)
        words = line.words
        if not line.skipped:
            for path in reads:
                if not trail.exists(path):
                    missing.append(f"{line.where}: `{line.command}` reads {path}, which nothing ships or makes "
                                   "earlier")
            for module in modules:
                file_ok = any(trail.exists(p) for p in (module.replace(".", "/") + ".py", module.replace(".", "/")))
                on_path = "." in line.env.get("PYTHONPATH", "").split(os.pathsep)
                if not installed(module) and not (file_ok and on_path):
                    missing.append(f"{line.where}: `{line.command}` imports {module}, which is "
                                   + ("not on the path: start the line with PYTHONPATH=." if file_ok else
                                      "neither installed nor written by an earlier block"))
        if words[0] in ("optkit", "torchrun") and len(words) > 1:
            optkit = words[words.index("optkit"):] if "optkit" in words else words
            if len(optkit) > 1 and optkit[1] in WRITES_FOLDER:
                out = normal(option_value(optkit, "--out") or "optkit-out")
                if "--resume" in optkit:
                    if out not in folders:
                        collisions.append(f"{line.where}: `{line.command}` resumes in {out}, which no earlier line "
                                          "filled")
                elif out in folders and "--force" not in optkit:
                    collisions.append(f"{line.where}: `{line.command}` writes into {out}, which {folders[out]} "
                                      "filled: optkit refuses (already holds results)")
                folders.setdefault(out, line.where)
        for path in writes:
            trail.make(path, line.where)
    return collisions, missing


def documented_steps() -> list[tuple[str, object]]:
    steps: list[tuple[str, object]] = []
    for block in blocks_in_order():
        steps.append(("block", block))
        if block.is_shell:
            steps += [("line", line) for line in block.lines()]
    return steps


def test_no_line_writes_where_an_earlier_line_wrote():
    collisions, _ = problems(documented_steps())
    assert not collisions, ("a user following the docs in order meets these refusals; give each page its own "
                            "folders (runs/<page>-<what>):\n" + "\n".join(collisions))


def test_every_file_a_line_reads_is_shipped_or_made_earlier():
    _, missing = problems(documented_steps())
    assert not missing, "in a fresh clone these lines cannot run as written:\n" + "\n".join(missing)


def _lines(*commands: str, action: str | None = None) -> list[tuple[str, object]]:
    return [("line", DocLine("README.md", i, command, action)) for i, command in enumerate(commands, 1)]


def test_the_checks_see_what_a_new_user_meets():
    """The lines #42 found: an unshipped model, a module off the path, folders filled twice, a resume of nothing."""
    collisions, missing = problems(_lines(
        "optkit optimize hf:models/tiny-llama --prune 0.3 --out runs/llm",
        "optkit optimize lm.pt --arch my_package.models:MyLM --out runs/lm",
        "optkit optimize torchvision:resnet18 --prune 0.3 --out runs/r18",
        "optkit optimize torchvision:resnet18 --prune 0.5 --out runs/r18",
        "optkit optimize torchvision:resnet18 --prune 0.5 --out runs/r18 --force",
        "optkit optimize model.pt --prune 0.5 --finetune fashion-mnist --resume --out runs/ft",
    ))
    assert [m.split(": `")[0] for m in missing] == ["README.md:1", "README.md:2", "README.md:2", "README.md:6"]
    assert "models/tiny-llama, which nothing ships" in missing[0]
    assert [c.split(": `")[0] for c in collisions] == ["README.md:4", "README.md:6"]
    _, missing = problems([("block", _write_block("my_package/models.py")), *_lines(
        "python -c \"import torch, my_package.models as m; torch.save(m.MyLM().state_dict(), 'lm.pt')\"",
        "optkit optimize lm.pt --arch my_package.models:MyLM --out runs/lm",
        "PYTHONPATH=. optkit optimize lm.pt --arch my_package.models:MyLM --out runs/lm2")])
    assert len(missing) == 1 and "start the line with PYTHONPATH=." in missing[0]


def _write_block(name: str):
    from doclines import Block

    return Block("README.md", 0, "python", "class MyLM: ...", "write", name)


def test_a_cheap_form_only_adds_flags():
    """What runs in place of a line is the line and more flags (``fashion-mnist`` becomes synthetic images only
    where it is not installed)."""
    for line in shell_lines():
        if line.cheap and line.words[0] == "optkit":
            cheap = cheap_form(line.words, fashion=True)
            assert cheap[: len(line.words) - 1] == line.words[1:], f"{line.where}: {cheap}"


def test_lines_that_cannot_run_here_are_marked():
    """make, torchrun and activating the environment cannot run as written inside the suite: their blocks say how
    the tests treat them."""
    for line in shell_lines():
        if line.words[0] == "make":
            assert line.cheap or line.skipped, f"{line.where}: `{line.command}` needs a docs-test: cheap marker"
        if line.words[0] == "torchrun":
            assert line.skipped, f"{line.where}: `{line.command}` needs a docs-test: skip marker"
        assert line.words[0] in {*PROGRAMS, "python", ".", "source", "ls", "cat", "head", "mkdir", "cp"}, (
            f"{line.where}: `{line.command}` is not a command the docs tests run")


PAGES = [str(p.relative_to(ROOT)) for p in reading_order()]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """One fresh copy of the repository for all pages, and the pages that ran."""
    if not fashion_installed() or not text_installed():
        pytest.skip("the documented lines train on Fashion-MNIST and read the Python documentation text "
                    "(`make data` installs both)")
    state = Runner(fresh_checkout(tmp_path_factory.mktemp("fresh-clone")), fashion=True)
    state.done = []
    # The cache starts empty, as a new user's does (tests/conftest.py gives each test its own).
    return state


def _short(error: BaseException) -> str:
    """An error in a few lines: its first lines and its last (optkit's one-line Error: comes last)."""
    lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return "\n    ".join(lines[:3] + (["..."] + lines[-2:] if len(lines) > 5 else lines[3:]))


@pytest.mark.slow  # about 20 minutes on 2 cores in all; each page first runs the pages before it
@pytest.mark.parametrize("page", PAGES)
def test_every_line_runs_in_document_order(page, runner, monkeypatch):
    """Each page's lines, after every earlier page's (a line that fails is reported and the next one runs, so one
    run shows every failure; a later line that needed its files fails too)."""
    # A user's shell and Python sessions start in the folder (optkit lines do not see it on sys.path: docrunner).
    monkeypatch.chdir(runner.folder)
    monkeypatch.syspath_prepend(str(runner.folder))
    failures: list[str] = []
    for earlier in PAGES[: PAGES.index(page) + 1]:
        if earlier in runner.done:
            continue
        for block in (b for b in blocks_in_order() if b.page == earlier):
            steps = block.lines() if block.is_shell and block.action != "skip" else [block]
            for step in steps:
                try:
                    if isinstance(step, DocLine):
                        output = runner.run_line(step)
                        if earlier == "README.md" and step.words[0] == "optkit":
                            args = cheap_form(step.words, fashion=True) if step.cheap else step.words[1:]
                            expect_what_the_readme_says(args, output, step.where, runner.folder)
                    else:
                        runner.run_block(step)
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 -- pytest.fail's outcome too: report, run the next line
                    where = step.where
                    failures.append(f"{where}: {_short(e)}" if earlier == page else f"(earlier page) {where}: "
                                    f"{_short(e)}")
        runner.done.append(earlier)
    assert not failures, "\n".join(failures)
