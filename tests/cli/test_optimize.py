"""``optkit optimize``'s pipeline from flags: a pass that splits for training is interleaved with the training."""

from __future__ import annotations

import pytest

from optkit.cli import optimize
from optkit.passes.prune.passes import StructuredPrune

RECALIBRATE = {"name": "recalibrate_batchnorm"}
FINETUNE = {"name": "finetune", "data": "synthetic:8"}
EXPORT = {"name": "export_onnx"}


def test_each_part_is_followed_by_the_recovery_passes_and_later_stages_run_once():
    prune = {"name": "structured_prune", "ratio": 0.5, "iterative_steps": 2}
    entries = optimize._interleave_steps([prune, RECALIBRATE, FINETUNE, EXPORT])
    assert [e["name"] for e in entries] == ["structured_prune", "recalibrate_batchnorm", "finetune"] * 2 + [
        "export_onnx"]
    step = 1 - 0.5 ** 0.5
    assert [e["ratio"] for e in entries if e["name"] == "structured_prune"] == pytest.approx([step, step])
    assert entries[1] is not entries[4]  # each repeat is its own entry


def test_the_cli_asks_the_pass_how_to_split(monkeypatch):
    parts = [{"name": "structured_prune", "ratio": 0.1}, {"name": "structured_prune", "ratio": 0.2}]
    monkeypatch.setattr(StructuredPrune, "split_for_training", classmethod(lambda cls, entry: parts))
    entries = optimize._interleave_steps([{"name": "structured_prune"}, FINETUNE])
    assert entries == [parts[0], FINETUNE, parts[1], FINETUNE]


@pytest.mark.parametrize("entries", [
    [{"name": "structured_prune", "ratio": 0.5, "iterative_steps": 3}, EXPORT],  # no training pass
    [{"name": "structured_prune", "target_macs": 0.5, "iterative_steps": 3}, FINETUNE],  # a target: one prune
    [{"name": "l1_unstructured", "ratio": 0.5}, FINETUNE],  # a pass that does not split
    [{"name": "structured_prune", "ratio": 0.5, "iterative_steps": 2}] * 2 + [FINETUNE],  # two would split
])
def test_nothing_is_split_otherwise(entries):
    assert optimize._interleave_steps(entries) == entries


def test_flags_build_the_interleaved_entries():
    entries = optimize.pass_entries_from_flags({"prune": 0.5, "iterative_steps": 3, "finetune": "synthetic:8",
                                                "workers": 0})
    assert [e["name"] for e in entries] == ["structured_prune", "finetune"] * 3
    assert all("iterative_steps" not in e for e in entries)


def test_training_and_importance_flags_land_in_the_recipe_it_ran(tmp_path):
    """Each flag sets its setting of the pass it declares, as the recipe optimize writes shows (#31)."""
    import tomllib

    from click.testing import CliRunner

    from optkit.cli import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "optimize", "torchvision:resnet18", "--input-shape", "1,3,32,32", "--num-classes", "10", "--prune", "0.3",
        "--importance", "l2", "--finetune", "synthetic:64:3x32x32:10", "--epochs", "1", "--max-steps", "1",
        "--batch-size", "16", "--lr", "2e-3", "--grad-clip", "0.5", "--warmup", "0.1", "--weight-decay", "0.01",
        "--train-amp", "off", "--seed", "3", "--distill", "--alpha", "0.4", "--temperature", "2",
        "--checkpoint-every", "1", "--max-train-samples", "64", "--no-latency", "--out", str(out)])
    assert result.exit_code == 0, result.output
    prune, finetune = tomllib.loads((out / "recipe.toml").read_text())["pass"]
    assert (prune["name"], prune["importance"]) == ("structured_prune", "l2")
    assert {k: finetune[k] for k in ("lr", "grad_clip", "warmup", "weight_decay", "amp", "seed", "distill", "alpha",
                                     "temperature", "checkpoint_every", "max_train_samples", "max_steps")} == {
        "lr": 2e-3, "grad_clip": 0.5, "warmup": 0.1, "weight_decay": 0.01, "amp": "off", "seed": 3, "distill": True,
        "alpha": 0.4, "temperature": 2.0, "checkpoint_every": 1, "max_train_samples": 64, "max_steps": 1}
