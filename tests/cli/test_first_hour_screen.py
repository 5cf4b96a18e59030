"""What the screen says in a new user's first hour (#42): each line as it should read."""

from __future__ import annotations

import io

from click.testing import CliRunner

from optkit.cli import main

SHIPPED = "optkit/demo/fashion_resnet.pt"
GRAY = "synthetic:64:1x28x28:10"
QUICK_TRAIN = ["--max-steps", "1", "--max-train-samples", "32", "--batch-size", "32", "--workers", "0"]


def test_the_missing_openvino_hint_prints_the_extra_and_the_editable_install():
    from rich.console import Console

    from optkit.analysis.report import print_report
    from optkit.runtime import openvino as ov

    out = io.StringIO()
    report = {"model": "m", "before": {"params": 1, "macs": 1, "sparsity": 0.0},
              "after": {"params": 1, "macs": 1, "sparsity": 0.0}, "passes": [], "notes": [ov.MISSING_NOTE]}
    print_report(report, Console(file=out, width=400))
    assert "`pip install -e '.[openvino]'` (in the optkit checkout) adds OpenVINO" in out.getvalue()


def test_a_random_weight_model_near_chance_is_said_to_be_random_not_misnormalized(tmp_path):
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "10", "--input-shape",
                                       "1,3,28,28", "--prune", "0.3", "--finetune", "synthetic:64:3x28x28:10",
                                       *QUICK_TRAIN, "--out", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "normalization" not in text and "warning" not in text.lower(), text
    assert "as expected: torchvision:resnet18 has random weights (nothing is downloaded)" in text


def test_a_trained_model_near_chance_still_gets_the_normalization_hint():
    from optkit.analysis.accuracy import chance_warning
    from optkit.io import models
    from optkit.io.weights import random_weights

    warning = chance_warning(0.1, 10, "fashion-mnist")
    assert "check the data's normalization" in warning
    assert random_weights(models.load(SHIPPED).model) is None
    assert "random weights" in random_weights(models.load("torchvision:resnet18", num_classes=10).model)


def test_a_detectors_export_is_said_to_be_checked_twice_at_its_fixed_batch():
    """The issue's "batch 1 ...; batch 1 ...": a detector takes a fixed number of images, so both checks are at
    that batch, on different inputs."""
    from optkit.workflow import verification_text

    twice = [{"batch_size": 1, "max_abs_diff": 1e-5, "tolerance": 2e-3},
             {"batch_size": 1, "max_abs_diff": 3e-5, "tolerance": 2e-3}]
    text = verification_text(twice)
    assert text.count("batch 1") == 1 and "the file takes a fixed batch" in text and "2 random inputs" in text
    two = [{"batch_size": 1, "max_abs_diff": 1e-5, "tolerance": 2e-3},
           {"batch_size": 3, "max_abs_diff": 1e-5, "tolerance": 2e-3}]
    assert verification_text(two) == "batch 1: max |diff| 1e-05 <= 0.002; batch 3: max |diff| 1e-05 <= 0.002"


def test_the_wrote_line_of_finetune_names_its_checkpoint(tmp_path):
    out = tmp_path / "tuned"
    result = CliRunner().invoke(main, ["finetune", SHIPPED, "--data", GRAY, "--epochs", "1", *QUICK_TRAIN,
                                       "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (out / "finetune.ckpt").is_file()
    (wrote,) = [line for line in result.output.splitlines() if line.startswith("Wrote ")]
    assert "finetune.ckpt" in wrote and "model.pt" in wrote and wrote.endswith(f"to {out}"), wrote
