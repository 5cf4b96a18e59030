"""The README's lines that the in-order run (tests/docs/test_every_line.py) runs in their cheap forms, at full size.

Those are the lines of the README's blocks marked ``docs-test: cheap``: the
demo ``make demo`` runs (the Makefile's command) and the fine-tune lines,
which train for epochs. Each runs here as written, in a fresh copy of the
repository, after the README's own set-up (``cp optkit/demo/fashion_resnet.pt
model.pt``) and the earlier line it continues (``runs/ft``).
"""

from __future__ import annotations

import pytest

from docrunner import Runner, demo_command, expect_what_the_readme_says, fashion_installed, fresh_checkout
from doclines import DocLine, documented_lines

README = [line for line in documented_lines() if line.page == "README.md"]
FULL_SIZE = [line for line in README if line.cheap and (line.words == ["make", "demo"] or line.words[0] == "optkit")]


@pytest.mark.slow  # each trains for one or two epochs on Fashion-MNIST: minutes on 2 cores
@pytest.mark.skipif(not fashion_installed(), reason="the README's lines train and score on Fashion-MNIST")
@pytest.mark.parametrize("line", FULL_SIZE, ids=lambda line: line.command[:60])
def test_readme_line_runs_as_written(line, tmp_path):
    runner = Runner(fresh_checkout(tmp_path), fashion=True)
    runner.run_line(DocLine(line.page, line.line, "cp optkit/demo/fashion_resnet.pt model.pt"))
    words = demo_command(fashion=True) if line.words[0] == "make" else line.words
    if "runs/ft" in line.command and (words[1] == "finetune" or "--resume" in words):
        first = next(other for other in README if "--distill --out runs/ft" in other.command)
        runner.optkit(first.words[1:], first.env, first.where)
    output = runner.optkit(words[1:], line.env, line.where)
    expect_what_the_readme_says(words[1:], output, line.where, runner.folder)


def test_the_full_size_lines_are_the_readmes_cheap_ones():
    assert {line.words[0] for line in FULL_SIZE} == {"make", "optkit"}
    assert any("--resume" in line.words for line in FULL_SIZE)
