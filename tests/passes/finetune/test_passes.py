"""Tests for the finetune pass, its recipe entry, the teacher the pipeline gives it, and the CLI flags."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.core.errors import DataError, PassError
from optkit.core.pipeline import Pipeline
from optkit.io import models
from optkit.passes.finetune import loop
from optkit.passes.finetune.passes import FineTune
from optkit.passes.prune.passes import StructuredPrune

DATA = "synthetic:32:3x16x16:4"


def small_cnn(in_channels: int = 3, classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))


@pytest.mark.parametrize("settings, message", [
    ({"data": ""}, "data must be a non-empty string"),
    ({"epochs": 0}, "epochs must be an integer >= 1"),
    ({"lr": 0}, "lr must be a number > 0"),
    ({"warmup": 1.0}, "warmup must be a number in [0, 1)"),
    ({"amp": "fp8"}, "amp must be one of auto, bf16, fp16, off"),
    ({"alpha": 1.5}, "alpha must be a number in [0, 1]"),
    ({"temperature": 0}, "temperature must be a number > 0"),
    ({"num_workers": "many"}, "num_workers must be an integer >= 0 or 'auto'"),
    ({"teacher": "model.pt"}, "teacher must be an nn.Module"),
    ({"max_steps": 0}, "max_steps must be an integer >= 1"),
    ({"max_train_samples": 0}, "max_train_samples must be an integer >= 1"),
    ({"max_steps": 2.5}, "max_steps must be an integer >= 1"),
])
def test_invalid_settings_name_the_valid_range(settings, message):
    with pytest.raises(ValueError) as info:
        FineTune(**{"data": DATA, **settings})
    assert message in str(info.value)


def test_recipe_round_trip_leaves_out_run_options():
    p = FineTune(data=DATA, epochs=3, lr=5e-4, distill=True, alpha=0.7, checkpoint="/tmp/x.ckpt", resume=True,
                 teacher=small_cnn())
    text = Pipeline([p], input_shape=(1, 3, 16, 16)).to_toml()
    for run_option in ("teacher", "resume", "checkpoint ="):
        assert run_option not in text
    again = Pipeline.from_toml(text).passes[0]
    assert isinstance(again, FineTune)
    assert again.settings() == p.settings()
    assert again.teacher is None and again.resume is False and again.checkpoint is None


def test_recipe_round_trip_keeps_the_training_caps():
    p = FineTune(data=DATA, max_train_samples=24, max_steps=5)
    text = Pipeline([p], input_shape=(1, 3, 16, 16)).to_toml()
    assert "max_train_samples = 24" in text and "max_steps = 5" in text
    again = Pipeline.from_toml(text).passes[0]
    assert (again.max_train_samples, again.max_steps) == (24, 5)
    assert again.settings() == p.settings()
    unset = Pipeline.from_toml(Pipeline([FineTune(data=DATA)], input_shape=(1, 3, 16, 16)).to_toml()).passes[0]
    assert unset.max_train_samples is None and unset.max_steps is None


def test_training_caps_take_effect_through_the_pass():
    # 32 training samples capped to 16, in batches of 8: 2 steps an epoch, so 5 steps end early in epoch 3 of 4
    # (uncapped, 4 steps an epoch would end in epoch 2; without max_steps, the run would take 4 epochs).
    result = FineTune(data=DATA, epochs=4, batch_size=8, num_workers=0, max_train_samples=16, max_steps=5,
                      input_shape=(1, 3, 16, 16)).apply(small_cnn())
    assert [h["epoch"] for h in result.details["history"]] == [1, 2, 3]
    assert result.details["history"][-1]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_pipeline_gives_the_unpruned_model_as_teacher(monkeypatch):
    seen = {}

    def fake_fit(model, train_set, val_set, settings, *, teacher=None):
        seen["teacher"], seen["student"], seen["settings"] = teacher, model, settings
        return loop.TrainResult(model)

    monkeypatch.setattr(loop, "fit", fake_fit)
    model = small_cnn()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    Pipeline([StructuredPrune(ratio=0.5, round_to=1), FineTune(data=DATA, distill=True)],
             input_shape=(1, 3, 16, 16)).run(model, measure_stats=False)
    teacher, student = seen["teacher"], seen["student"]
    assert isinstance(seen["settings"], FineTune) and seen["settings"].distill
    assert teacher is not student
    assert teacher[0].out_channels == 16 and student[0].out_channels == 8
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, original[key]), key


def test_distill_outside_a_pipeline_needs_a_teacher():
    with pytest.raises(DataError, match="teacher"):
        FineTune(data=DATA, distill=True).apply(small_cnn())


def test_wrong_class_count_is_a_data_error():
    with pytest.raises(PassError, match="--num-classes 4"):
        Pipeline([FineTune(data=DATA)], input_shape=(1, 3, 16, 16)).run(small_cnn(classes=2), measure_stats=False)


def test_grayscale_data_is_adapted_to_an_rgb_model_of_another_size():
    model = small_cnn()
    result = FineTune(data="synthetic:32:1x20x20:4", epochs=2, batch_size=8, lr=1e-2, num_workers=0,
                      input_shape=(1, 3, 12, 12), seed=1).apply(model)
    details = result.details
    assert len(details["history"]) == 2 and 0.0 <= details["val_accuracy"] <= 1.0
    assert details["best_epoch"] in (1, 2)
    assert all(math.isfinite(h["train_loss"]) for h in details["history"])


def test_iterative_steps_compound_to_the_total_ratio():
    from optkit.cli.optimize import pass_entries_from_flags

    flags = {"prune": 0.5, "iterative_steps": 3, "finetune": DATA, "epochs": 1, "batch_size": 8, "distill": True,
             "train_amp": "auto", "workers": 0}
    entries = pass_entries_from_flags(flags)
    assert [e["name"] for e in entries] == ["structured_prune", "finetune"] * 3
    kept = math.prod(1 - e["ratio"] for e in entries if e["name"] == "structured_prune")
    assert kept == pytest.approx(0.5, rel=1e-12)
    assert all(e["num_workers"] == 0 and e["amp"] == "auto" for e in entries if e["name"] == "finetune")
    Pipeline.from_dict({"pass": entries})


def test_cli_prune_then_finetune_writes_a_model_that_reloads(tmp_path):
    from optkit.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "optimize", "torchvision:mobilenet_v3_small", "--num-classes", "4", "--prune", "0.3",
        "--finetune", "synthetic:32:3x32x32:4", "--epochs", "1", "--batch-size", "16", "--workers", "0",
        "--distill", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "finetune.ckpt").exists()
    recipe = (out / "recipe.toml").read_text()
    assert 'name = "finetune"' in recipe and "distill = true" in recipe and "input_shape = [1, 3, 32, 32]" in recipe
    model = models.load_model(out / "model.pt")
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_cli_distill_without_teacher_is_a_usage_error():
    from optkit.cli import main

    result = CliRunner().invoke(main, ["finetune", "torchvision:resnet18", "--data", DATA, "--distill"])
    assert result.exit_code == 2
    assert "--distill needs --teacher" in result.output


def test_cli_finetune_resume_of_a_finished_run_gives_the_same_model(tmp_path):
    from optkit.cli import main

    args = ["finetune", "torchvision:mobilenet_v3_small", "--num-classes", "4", "--data", "synthetic:32:3x32x32:4",
            "--epochs", "1", "--batch-size", "16", "--workers", "0", "--out", str(tmp_path)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "Best validation accuracy" in first.output
    trained = models.load_model(tmp_path / "model.pt").state_dict()
    again = CliRunner().invoke(main, [*args, "--resume", "--force"])
    assert again.exit_code == 0, again.output
    for key, value in models.load_model(tmp_path / "model.pt").state_dict().items():
        assert torch.equal(value, trained[key]), key
