"""Findings of #31 in the command line and the prune report: a recipe's settings overridden by flags, the
``Wrote`` line, a recipe's input shape named in the error, and the reason a layer with no ratio was skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from doclines import ROOT
from optkit.cli import main

SHIPPED = ROOT / "optkit" / "demo" / "fashion_resnet.pt"
GRAY = "synthetic:64:1x28x28:10"
QUICK_TRAIN = ["--max-train-samples", "64", "--batch-size", "32", "--workers", "0"]


@pytest.fixture(scope="module")
def demo_like(tmp_path_factory):
    """A recipe as `make demo` writes one (the Fashion model's 1x28x28 input; prune, recalibrate, fine-tune)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    result = CliRunner().invoke(main, ["optimize", str(SHIPPED), "--prune", "0.5", "--recalibrate-bn", "2",
                                       "--calib-data", GRAY, "--finetune", GRAY, "--epochs", "1", "--max-steps", "2",
                                       *QUICK_TRAIN, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_max_steps_overrides_the_finetune_pass_of_a_recipe(demo_like, tmp_path):
    result = CliRunner().invoke(main, ["optimize", str(SHIPPED), "--recipe", str(demo_like / "recipe.toml"),
                                       "--max-steps", "1", "--out", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert "max_steps = 1" in (tmp_path / "again" / "recipe.toml").read_text()


def test_the_wrote_line_names_the_finetune_checkpoint(demo_like):
    assert (demo_like / "finetune.ckpt").is_file()
    result = CliRunner().invoke(main, ["optimize", str(SHIPPED), "--prune", "0.5", "--finetune", GRAY, "--epochs",
                                       "1", "--max-steps", "1", *QUICK_TRAIN, "--out", str(demo_like), "--force"])
    wrote = [line for line in result.output.splitlines() if line.startswith("Wrote ")]
    assert wrote and "finetune.ckpt" in wrote[-1], result.output


def test_a_recipe_for_another_model_says_which_shape_it_carries(demo_like, tmp_path):
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--recipe", str(demo_like / "recipe.toml"),
                                       "--out", str(tmp_path / "again")])
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert "recipe" in line and "--input-shape" in line and "--num-classes" in line, line


def test_a_layer_the_recipe_gives_no_ratio_is_not_said_to_be_lost_to_rounding():
    from optkit.io import models
    from optkit.passes.prune.passes import StructuredPrune

    model = models.load(str(SHIPPED)).model
    prune = StructuredPrune(ratio=0.0, layer_ratios={"stem.0": 0.5, "layer2.conv1": 0.5}, input_shape=(1, 1, 28, 28))
    reason = prune.apply(model).details["skipped_layers"]["layer3.conv1"]
    assert "round_to" not in reason and "no ratio" in reason, reason


def test_the_shipped_recipe_line_of_the_readme_runs_after_the_batchnorm_fix(demo_like, tmp_path):
    """The README's line as it now reads: the recipe's data is adapted to the RGB model in recalibration too."""
    shutil.copy(demo_like / "recipe.toml", tmp_path / "recipe.toml")
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--recipe", str(tmp_path / "recipe.toml"),
                                       "--input-shape", "1,3,28,28", "--num-classes", "10",
                                       "--out", str(tmp_path / "again")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert Path(tmp_path / "again" / "model.pt").is_file()
