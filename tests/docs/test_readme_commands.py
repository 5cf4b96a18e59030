"""Every documented line that tests/test_docs.py does not run runs here, in order, in one folder (#31).

Those are the lines of README.md and of the docs' blocks marked
``docs-test: skip``. The default run uses each line's cheap form
(:func:`doclines.cheap_form`), in process through click's CliRunner; ``make
demo`` is the Makefile's own demo command in that form (and a page quoting
that command is covered by it). ``model.pt`` is the shipped Fashion-MNIST
model, copied in as the README suggests. Lines another test covers are
listed in :data:`doclines.COVERED_ELSEWHERE`. The slow tier runs the README's
lines as written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from doclines import (COVERED_ELSEWHERE, ROOT, cheap_form, demo_command, documented_lines, option_value,
                      promised_files)
from optkit.cli import main
from optkit.data.datasets import FASHION_MNIST_DIR

FASHION = (Path(FASHION_MNIST_DIR) / "train-images-idx3-ubyte.gz").is_file()
SHIPPED = ROOT / "optkit" / "demo" / "fashion_resnet.pt"
SHIPPED_LM = ROOT / "optkit" / "demo" / "python_docs_lm"
README = [line for line in documented_lines() if line.page == "README.md"]
DEMO = demo_command()


def _run_here() -> list:
    """README lines, then lines of skipped docs blocks; each command once, none covered elsewhere."""
    lines = README + [line for line in documented_lines() if line.skipped]
    seen = {"optkit " + " ".join(DEMO[1:])} | set(COVERED_ELSEWHERE)
    chosen = []
    for line in lines:
        if line.command not in seen:
            seen.add(line.command)
            chosen.append(line)
    return chosen


RUN_HERE = _run_here()
#: What an interrupted run leaves in its folder: the training checkpoint, none of the files written at the end.
FINAL_OUTPUTS = ("model.pt", "recipe.toml", "report.json", "report.md", "channels.png")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The user's checkout: the shipped model where optkit keeps it, and as their own ``model.pt``."""
    here = tmp_path_factory.mktemp("readme")
    checkout(here)
    return here


def checkout(here: Path) -> None:
    (here / SHIPPED.relative_to(ROOT)).parent.mkdir(parents=True)
    shutil.copy(SHIPPED, here / SHIPPED.relative_to(ROOT))
    shutil.copy(SHIPPED, here / "model.pt")
    shutil.copytree(SHIPPED_LM, here / SHIPPED_LM.relative_to(ROOT))


def run(args: list[str], where: str) -> str:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, f"{where}: `optkit {' '.join(args)}` exited {result.exit_code}:\n{result.output}"
    return " ".join(result.output.split())


def check_files(args: list[str], where: str) -> None:
    out = Path(option_value(args, "--out") or "optkit-out")
    missing = [name for name in promised_files(args) if not (out / name).is_file()]
    assert not missing, f"{where}: `optkit {' '.join(args)}` did not write {missing} in {out}"


def interrupt(args: list[str]) -> None:
    """Leave ``--out`` as a crash after the last checkpoint would (what ``--resume`` is documented for)."""
    out = Path(option_value(args, "--out"))
    assert (out / "finetune.ckpt").is_file(), f"{out} holds no checkpoint to resume from"
    for name in FINAL_OUTPUTS:
        (out / name).unlink(missing_ok=True)


def readme_id(line) -> str:
    return f"{line.where}:{line.words[1] if len(line.words) > 1 else ''}:{RUN_HERE.index(line)}"


@pytest.mark.slow  # 6-10 minutes on 2 cores: over the default run's budget; the lines' behaviours have fast tests
@pytest.mark.parametrize("line", RUN_HERE, ids=readme_id)
def test_readme_line_runs_in_its_cheap_form(line, folder, monkeypatch):
    monkeypatch.chdir(folder)
    if line.words[0] == "make":
        assert line.words == ["make", "demo"], f"{line.where}: no cheap form for `{line.command}`"
        args = cheap_form(DEMO, fashion=FASHION)
    else:
        assert line.words[0] == "optkit", f"{line.where}: no cheap form for `{line.command}`"
        args = cheap_form(line.words, fashion=FASHION)
    if "--resume" in args:
        interrupt(args)
    output = run(args, line.where)
    check_files(args, line.where)
    expect_what_the_readme_says(args, output, line.where)


def expect_what_the_readme_says(args: list[str], output: str, where: str) -> None:
    """The promises of the prose around a line, beyond its exit code and files."""
    out = Path(option_value(args, "--out") or ".")
    if "--resume" in args:
        assert f"resumed from {out / 'finetune.ckpt'}" in output, f"{where}: the resumed run did not say so:\n{output}"
    if args[1:2] == ["model.pt"] and (option_value(args, "--prune") == "0.3" or "--iterative-steps" in args):
        # The shipped model's 32- and 64-channel layers, rounded to multiples of 16, lose more than asked.
        notes = json.loads((out / "report.json").read_text())["notes"]
        asked = f"not the {float(option_value(args, '--prune')):.0%} asked"
        assert any(asked in note for note in notes), f"{where}: no note that rounding moved the result: {notes}"
    if args[0] == "bench" and "--compare" in args:
        assert "A / B = " in output, output
    if args[0] == "inspect":
        assert "MACs" in output, output




@pytest.mark.slow
@pytest.mark.skipif(not FASHION, reason="the README's lines train and score on Fashion-MNIST")
@pytest.mark.parametrize("line", [line for line in README if line.words[0] == "optkit"], ids=lambda l: l.command[:60])
def test_readme_line_runs_as_written(line, tmp_path, monkeypatch):
    """The full-size form: the line as written, after the README's own set-up (model.pt, make demo, weights.pt)."""
    monkeypatch.chdir(tmp_path)
    checkout(tmp_path)
    args = line.words[1:]
    if "runs/demo" in line.command:
        run(DEMO[1:], "make demo")
    if "weights.pt" in args:
        from optkit.io import models

        arch = models.arch_spec(option_value(args, "--arch"), int(option_value(args, "--num-classes")))
        torch.save(arch.build().state_dict(), tmp_path / "weights.pt")
    if "runs/ft" in line.command and args[0] == "finetune" or "--resume" in args:
        first = next(other for other in README if "--distill --out runs/ft" in other.command)
        run(first.words[1:], line.where)
        if "--resume" in args:
            interrupt(args)
    if args[0] == "export":
        run(next(o for o in README if "--out runs/r18" in o.command).words[1:], line.where)
    output = run(args, line.where)
    check_files(args, line.where)
    expect_what_the_readme_says(args, output, line.where)
