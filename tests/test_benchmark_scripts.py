"""The benchmark scripts: `--help` prints help, and a cheap or partial run never overwrites the committed tables
(#42). Their measurements are the scripts' own business; this checks how they are run."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
#: Scripts whose partial runs keep the other rows of the committed file (they read it, then replace their own rows).
MERGE_PARTIAL_RUNS = {"hf_zoo.py", "hf_beyond.py", "timm_cli.py"}
#: Scripts that write results but have no option that narrows a run (nothing can be partial), or write only where
#: told (``--out`` is required).
NOTHING_PARTIAL = {"bias_correction.py", "sensitivity.py", "compare_speedup.py"}
#: Partial runs that still write into benchmarks/results/: a gap to close, never to grow. demo_regression.py reruns
#: with fewer repeats by design.
NOT_YET_GUARDED = {"demo_regression.py", "llm_scale.py"}


@pytest.fixture
def benchmarks_importable(monkeypatch, tmp_path):
    """The scripts import their helpers as the interpreter sees them when run as files (benchmarks/ first);
    partial runs write under ``tmp_path``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("_results")
    monkeypatch.setattr(results, "PARTIAL", tmp_path / "partial")
    return results


def test_a_partial_run_writes_outside_the_committed_results(benchmarks_importable, tmp_path):
    results = benchmarks_importable
    committed = results.RESULTS / "round-to.md"
    assert results.destination(committed, []) == committed
    moved = results.destination(committed, ["models resnet18"])
    assert moved == tmp_path / "partial" / "results" / "round-to.md"
    elsewhere = tmp_path / "mine" / "round-to.md"
    assert results.destination(elsewhere, ["models resnet18"]) == elsewhere
    shipped = ROOT / "optkit" / "demo" / "python_docs_lm"
    assert results.destination(shipped, ["--minutes 1"], committed=shipped).parent == tmp_path / "partial"


def test_partial_options_name_what_differs_from_the_defaults(benchmarks_importable):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="a,b")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(["--quick", "--repeats", "2"])
    assert benchmarks_importable.partial_options(parser, args, ["models", "quick", "repeats"]) == [
        "--quick", "--repeats 2"]


def test_round_to_on_one_model_leaves_the_committed_table_alone(benchmarks_importable, tmp_path, monkeypatch):
    round_to = importlib.import_module("round_to")
    monkeypatch.setattr(round_to, "run_model", lambda name, scratch: {"model": name, "input_shape": [1, 3, 8, 8],
                                                                       "variants": [], "runs": []})
    committed = {p: p.read_bytes() for p in (round_to.RESULTS / "round-to.json", round_to.RESULTS / "round-to.md")}
    round_to.main(["resnet18"])
    assert {p: p.read_bytes() for p in committed} == committed
    assert "## resnet18" in (tmp_path / "partial" / "results" / "round-to.md").read_text()


def test_round_to_help_prints_help():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "round_to.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("usage: round_to.py")


def test_every_script_that_can_run_partially_guards_the_committed_results():
    narrowing = re.compile(r'add_argument\("(--models|--quick|--only|--types|--parts|--fractions|--train-size|'
                           r'--repeats|--minutes|--steps)"|nargs="\*"')
    unguarded = sorted(p.name for p in SCRIPTS if narrowing.search(p.read_text(encoding="utf-8"))
                       and "destination(" not in p.read_text(encoding="utf-8")
                       and p.name not in MERGE_PARTIAL_RUNS | NOTHING_PARTIAL | NOT_YET_GUARDED)
    assert not unguarded, f"partial runs of {unguarded} would overwrite benchmarks/results/: use _results.destination"
    guarded = sorted(name for name in NOT_YET_GUARDED
                     if (BENCHMARKS / name).is_file() and "destination(" in (BENCHMARKS / name).read_text())
    assert not guarded, f"{guarded} now guard their results: remove them from NOT_YET_GUARDED"


@pytest.mark.slow  # every script imports torch: about a minute on 2 cores
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_of_every_benchmark_prints_help(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.parametrize(("script", "render", "name"), [("zoo", "timm_markdown", "zoo-timm"), ("zoo", "markdown", "zoo"),
                                                        ("hf_zoo", "markdown", "hf-zoo")])
def test_results_recorded_with_another_torch_pruning_say_so(benchmarks_importable, script, render, name):
    """zoo-timm.md recorded torch-pruning 1.6.0 while pyproject.toml pins 1.6.1 (#42): the file says so in its
    header, and is exactly what its script renders from its JSON (so a rerun keeps saying it while it is true)."""
    import json

    data = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
    committed = (BENCHMARKS / "results" / f"{name}.md").read_text()
    note = benchmarks_importable.pin_note("torch-pruning", data["torch_pruning"])
    if data["torch_pruning"] != benchmarks_importable.pinned("torch-pruning"):
        assert note and note in committed.split("\n\n")[2]
    assert getattr(importlib.import_module(script), render)(data) == committed
