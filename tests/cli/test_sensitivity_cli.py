"""`optkit sensitivity`: curves, plot and a recipe whose MACs equal the ones it reports."""

from __future__ import annotations

import json

import pytest
import torch
from usernets import BranchyNet

from optkit.passes.prune.targets.curves_report import OUTPUT_FILES
from optkit.cli import main

DATA = "synthetic:64:3x32x32:4"
QUICK = ["--samples", "32", "--calibration-samples", "32", "--ratios", "0.5", "--round-to", "4"]


@pytest.fixture
def model_args(tmp_path):
    """A saved state_dict (fixed weights: the cache is keyed by them) and how to read it."""
    path = tmp_path / "branchy.pt"
    torch.save(BranchyNet(num_classes=4).state_dict(), path)
    return [str(path), "--arch", "usernets:BranchyNet", "--num-classes", "4", "--input-shape", "1,3,32,32"]


def test_sensitivity_writes_curves_and_a_recipe_that_reproduces_its_macs(runner, tmp_path, model_args):
    MODEL = model_args
    out = tmp_path / "sens"
    result = runner.invoke(main, ["sensitivity", *MODEL, "--data", DATA, *QUICK, "--target-macs", "0.6",
                                  "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)
    summary = json.loads((out / "sensitivity.json").read_text())
    assert summary["curves"] and all(len(c["points"]) == 1 for c in summary["curves"])
    achieved = summary["allocation"]["achieved_fraction"]
    assert abs(achieved - 0.6) <= 0.02
    assert (out / "sensitivity.png").read_bytes().startswith(b"\x89PNG")
    assert "| group |" in (out / "sensitivity.md").read_text()
    kept = [c for c in summary["allocation"]["candidates"] if c["spread"] == summary["allocation"]["spread"]]
    assert len(kept) == 1 and kept[0]["achieved_fraction"] == pytest.approx(achieved, abs=1e-4)
    if len(summary["allocation"]["candidates"]) > 1:
        assert "(kept)" in (out / "sensitivity.md").read_text()

    run = tmp_path / "run"
    replay = runner.invoke(main, ["optimize", *MODEL, "--recipe", str(out / "recipe.toml"), "--out", str(run)],
                           catch_exceptions=False)
    assert replay.exit_code == 0, replay.output
    report = json.loads((run / "report.json").read_text())
    assert report["after"]["macs"] / report["before"]["macs"] == pytest.approx(achieved, abs=1e-4)

    again = runner.invoke(main, ["sensitivity", *MODEL, "--data", DATA, *QUICK, "--target-macs", "0.6",
                                 "--out", str(out), "--force"], catch_exceptions=False)
    assert again.exit_code == 0 and "0 points measured" in again.output


def test_data_the_model_does_not_fit_is_one_line_and_writes_nothing(runner, tmp_path, model_args):
    MODEL = model_args
    out = tmp_path / "sens"
    result = runner.invoke(main, ["sensitivity", *MODEL, "--data", "synthetic:64:3x32x32:7", *QUICK,
                                  "--out", str(out)])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "--num-classes 7" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_sensitivity_needs_data(runner, tmp_path, model_args):
    result = runner.invoke(main, ["sensitivity", *model_args, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "--data" in result.output


def test_optimize_with_sensitivity_allocation_reports_it(runner, tmp_path, model_args):
    out = tmp_path / "run"
    result = runner.invoke(main, ["optimize", *model_args, "--target-macs", "0.6", "--allocation", "sensitivity",
                                  "--calib-data", DATA, "--round-to", "4", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    details = report["passes"][0]["details"]
    assert details["allocation"] == "sensitivity" and details["layer_ratios"]
    assert report["after"]["macs"] / report["before"]["macs"] == pytest.approx(0.6, abs=0.02)


def test_sensitivity_allocation_without_a_macs_target_is_one_line(runner, tmp_path, model_args):
    result = runner.invoke(main, ["optimize", *model_args, "--prune", "0.3", "--allocation", "sensitivity",
                                  "--calib-data", DATA, "--out", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert "needs target_macs" in result.output or "needs --target-macs" in result.output
    assert not (tmp_path / "run" / "model.pt").exists()
