"""Runs documented code as a user does: in a fresh copy of the repository, block after block, in reading order.

What each kind of block and line does here (#42):

* a shell line runs **as written**, or in its cheap form when its block is
  marked ``<!-- docs-test: cheap (why) -->`` (:func:`doclines.cheap_form`
  only adds flags that shrink the work); a block marked ``skip`` does not run;
* ``optkit ...`` runs in this process through click's CliRunner, but sees
  what a new ``optkit`` process would: the folder the user is in is not on
  ``sys.path`` unless the line sets ``PYTHONPATH`` (a console script does not
  add it), modules an earlier block imported from the folder are forgotten,
  and torch's random state starts from one seed (what random weights a
  ``torchvision:NAME`` line builds does not depend on the lines before it);
* ``python ...`` runs in a subprocess of this interpreter, in the folder,
  with only the ``PYTHONPATH`` the line sets;
* ``ls``, ``cat``, ``head``, ``mkdir``, ``cp`` run as they are;
* ``. .venv/bin/activate`` is the environment the tests already run in (it
  must be a virtual environment);
* ``make demo`` (in a ``cheap`` block) runs the optkit command the Makefile's
  demo runs on this machine, in its cheap form; other ``make`` targets are
  dry-run (``make -n``): ``make test`` is this suite itself;
* ``python`` blocks run (one namespace per page), ``write`` blocks are saved
  as their file, ``toml`` blocks holding ``[[pass]]`` tables are parsed;
* a line with ``--resume`` ("after a crash") first leaves its ``--out``
  folder as a crash would: the checkpoint an earlier line wrote, none of the
  results.

Every ``optimize``, ``finetune`` and ``sensitivity`` line must exit 0 and
write the files the docs promise (:func:`doclines.promised_files`), so a line
that needs a file nothing ships or makes, or whose ``--out`` an earlier line
filled, fails where it stands.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from doclines import ROOT, Block, DocLine, cheap_form, make_variable, option_value, promised_files

SHELL_COMMANDS = {"ls", "cat", "head", "mkdir", "cp"}
#: What an interrupted run leaves in its folder: the training checkpoint, none of the files written at the end.
FINAL_OUTPUTS = ("model.pt", "recipe.toml", "report.json", "report.md", "channels.png")


def fashion_installed() -> bool:
    from optkit.data.datasets import FASHION_MNIST_DIR

    return (Path(FASHION_MNIST_DIR) / "train-images-idx3-ubyte.gz").is_file()


def text_installed() -> bool:
    from optkit.data.text import PYTHON_DOCS_DIR

    return Path(PYTHON_DOCS_DIR).is_dir()


def fresh_checkout(folder: Path) -> Path:
    """The repository's tracked files, as the working tree holds them, copied into ``folder``: what a clone of
    this change holds, and nothing else (no ``.venv``, no ``runs/``, no untracked files)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode == 0:
        names = [os.fsdecode(name) for name in done.stdout.split(b"\0") if name]
    else:  # not a git checkout (an unpacked archive): every file but the environment's and the runs'
        left_out = {".git", ".venv", "runs", "__pycache__", "site"}
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not left_out & set(p.relative_to(ROOT).parts)]
    for name in names:
        source = ROOT / name
        if source.is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return folder


def demo_command(fashion: bool) -> list[str]:
    """The optkit command ``make demo`` runs here: the trained demo with Fashion-MNIST, else the random one."""
    words = shlex.split(make_variable("DEMO_TRAINED" if fashion else "DEMO_RANDOM")
                        .replace("$(DEMO_MODEL)", make_variable("DEMO_MODEL")))
    assert words[0] == "$(BIN)/optkit", words
    return ["optkit", *words[1:]]


class Runner:
    """Runs blocks in one folder, keeping what earlier blocks wrote.

    Args:
        folder: the fresh folder (see :func:`fresh_checkout`).
        fashion: whether Fashion-MNIST is installed (without it, cheap forms use synthetic images).
    """

    def __init__(self, folder: Path, *, fashion: bool = True):
        self.folder = folder.resolve()
        self.fashion = fashion
        self.namespaces: dict[str, dict] = {}
        self.outputs: dict[str, str] = {}

    def run_block(self, block: Block) -> None:
        where = block.where
        if block.action == "skip":
            return
        if block.action == "write":
            assert block.arg, f"{where}: docs-test: write needs a file name"
            path = self.folder / block.arg
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body + "\n", encoding="utf-8")
        elif block.lang == "python":
            exec(compile(block.body, where, "exec"), self._namespace(block.page))
        elif block.is_shell:
            for line in block.lines():
                self.run_line(line)
        elif block.lang == "toml" and "[[pass]]" in block.body:
            from optkit.core.pipeline import Pipeline

            Pipeline.from_toml(block.body, source=where)

    def _namespace(self, page: str) -> dict:
        if page not in self.namespaces:
            # A real module, so classes defined in the examples (dataclasses too) know where they live.
            module = types.ModuleType("docs_in_order_" + re.sub(r"\W", "_", page))
            sys.modules[module.__name__] = module
            self.namespaces[page] = module.__dict__
        return self.namespaces[page]

    def run_line(self, line: DocLine) -> str:
        """Run one documented line (see the module docstring); returns what optkit printed, flattened."""
        where, words, env = line.where, line.words, line.env
        program = words[0]
        if program in (".", "source"):
            assert len(words) == 2 and words[1].endswith("bin/activate"), f"{where}: `{line.command}`"
            assert (Path(sys.prefix) / "bin" / "activate").is_file(), "the tests run outside a virtual environment"
            return ""
        if program == "optkit":
            args = cheap_form(words, fashion=self.fashion) if line.cheap else words[1:]
            return self.optkit(args, env, where)
        if program == "make":
            assert line.cheap, (f"{where}: `{line.command}` sets up or runs the whole suite; mark its block "
                                "<!-- docs-test: cheap (why) --> so the tests run what it runs, cheaply")
            if words[1:] == ["demo"]:
                return self.optkit(cheap_form(demo_command(self.fashion), fashion=self.fashion), env, where)
            done = subprocess.run(["make", "--no-print-directory", "-n", *words[1:]], cwd=self.folder,
                                  capture_output=True, text=True, timeout=120,
                                  env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")})
            assert done.returncode == 0, f"{where}: `make -n {' '.join(words[1:])}` failed:\n{done.stderr}"
            return ""
        if program == "python":
            command = [sys.executable, *words[1:]]
        elif program in SHELL_COMMANDS:
            command = words
        else:
            pytest.fail(f"{where}: `{line.command}` is not a command the docs tests run; mark its block "
                        "<!-- docs-test: skip (why) --> and name the test that runs it in doclines.COVERED_ELSEWHERE")
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(command, cwd=self.folder, capture_output=True, text=True, timeout=600,
                              env={**inherited, **env})
        assert done.returncode == 0, f"{where}: `{line.command}` failed:\n{done.stdout}{done.stderr}"
        return done.stdout

    def optkit(self, args: list[str], env: dict[str, str], where: str) -> str:
        """``optkit ARGS`` in this process, as a new process started in the folder would run it."""
        from optkit.cli import main

        if "--resume" in args:
            self.interrupt(args, where)
        extra = [str((self.folder / p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        saved = list(sys.path)
        sys.path[:] = extra + [p for p in saved if p not in ("", ".") and Path(p).resolve() != self.folder]
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file and self.folder in Path(file).resolve().parents:
                del sys.modules[name]
        import importlib

        importlib.invalidate_caches()
        # A new process's random state does not depend on the lines before it: each line starts from one seed.
        import torch

        torch.manual_seed(0)
        cwd = os.getcwd()
        os.chdir(self.folder)
        try:
            result = CliRunner(env=env).invoke(main, args, catch_exceptions=False)
        finally:
            os.chdir(cwd)
            sys.path[:] = saved
        shown = f"optkit {shlex.join(args)}"
        assert result.exit_code == 0, f"{where}: `{shown}` exited {result.exit_code}:\n{result.output}"
        missing = [name for name in promised_files(args) if not (self._out(args) / name).is_file()]
        assert not missing, f"{where}: `{shown}` did not write {missing} in {self._out(args)}"
        return " ".join(result.output.split())

    def _out(self, args: list[str]) -> Path:
        return self.folder / (option_value(args, "--out") or "optkit-out")

    def interrupt(self, args: list[str], where: str) -> None:
        """Leave ``--out`` as a crash after the last checkpoint would (what ``--resume`` is documented for)."""
        out = self._out(args)
        checkpoints = sorted(out.glob("finetune*.ckpt"))
        assert checkpoints, f"{where}: {out.relative_to(self.folder)} holds no checkpoint an earlier line wrote"
        for name in FINAL_OUTPUTS:
            (out / name).unlink(missing_ok=True)


def expect_what_the_readme_says(args: list[str], output: str, where: str, folder: Path) -> None:
    """The promises of the README's prose around a line, beyond its exit code and files."""
    out = folder / (option_value(args, "--out") or ".")
    if "--resume" in args:
        assert f"resumed from {option_value(args, '--out')}/finetune.ckpt" in output, (
            f"{where}: the resumed run did not say so:\n{output}")
    if args[1:2] == ["model.pt"] and (option_value(args, "--prune") == "0.3" or "--iterative-steps" in args):
        # The shipped model's 32- and 64-channel layers, rounded to multiples of 16, lose more than asked.
        notes = json.loads((out / "report.json").read_text())["notes"]
        asked = f"not the {float(option_value(args, '--prune')):.0%} asked"
        assert any(asked in note for note in notes), f"{where}: no note that rounding moved the result: {notes}"
    if args[0] == "bench" and "--compare" in args:
        assert "A / B = " in output, output
    if args[0] == "inspect":
        assert "MACs" in output, output
