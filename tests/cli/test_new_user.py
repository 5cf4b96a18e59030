"""What a new user hit with their own model: input shapes, remembered architectures, early checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optkit.cli import main
from usernets import GrayNet

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture
def gray_weights(tmp_path):
    path = tmp_path / "gray.pt"
    torch.save(GrayNet().state_dict(), path)
    return path


def _optimize(runner, weights, out, *extra):
    return runner.invoke(main, ["optimize", str(weights), "--arch", "usernets:GrayNet", "--prune", "0.25",
                                "--out", str(out), *extra])


def test_the_first_convs_channels_set_the_input_shape(runner, gray_weights, tmp_path):
    result = _optimize(runner, gray_weights, tmp_path / "o", "--input-shape", "1,1,28,28")
    assert result.exit_code == 0, result.output
    inspect = runner.invoke(main, ["inspect", str(tmp_path / "o" / "model.pt"), "--json"])
    assert inspect.exit_code == 0, inspect.output
    assert json.loads(inspect.output)["input_shape"] == [1, 1, 28, 28]


def test_a_recorded_input_shape_is_used_again_by_every_command(runner, gray_weights, tmp_path):
    assert _optimize(runner, gray_weights, tmp_path / "o", "--input-shape", "1,1,28,28").exit_code == 0
    model = str(tmp_path / "o" / "model.pt")
    again = runner.invoke(main, ["optimize", model, "--prune", "0.2", "--out", str(tmp_path / "o2")])
    assert again.exit_code == 0, again.output
    assert "input_shape = [1, 1, 28, 28]" in (tmp_path / "o2" / "recipe.toml").read_text()
    exported = runner.invoke(main, ["export", model, "--onnx", str(tmp_path / "m.onnx")])
    assert exported.exit_code == 0, exported.output


def test_without_a_recorded_shape_the_error_names_the_option(runner, gray_weights, tmp_path):
    result = _optimize(runner, gray_weights, tmp_path / "o")
    assert result.exit_code == 1
    assert "1,1,224,224" in result.output and "--input-shape" in result.output


def _fresh_process(*args: str, cache: Path) -> subprocess.CompletedProcess:
    # A new interpreter, so the user's module is not already imported (as in a new shell).
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "OPTKIT_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "optkit", *args], capture_output=True, text=True, env=env)


def test_a_confirmed_architecture_is_remembered_for_the_file_optkit_wrote(gray_weights, tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "o"
    first = _fresh_process("optimize", str(gray_weights), "--arch", "usernets:GrayNet", "--input-shape",
                           "1,1,28,28", "--prune", "0.25", "--out", str(out), cache=cache)
    assert first.returncode == 0, first.stderr
    inspect = _fresh_process("inspect", str(out / "model.pt"), cache=cache)
    assert inspect.returncode == 0, inspect.stderr
    copy = tmp_path / "copy.pt"
    copy.write_bytes((out / "model.pt").read_bytes())
    changed = tmp_path / "changed.pt"
    data = torch.load(out / "model.pt", weights_only=True)
    data["extra"]["note"] = "edited elsewhere"
    torch.save(data, changed)
    refused = _fresh_process("inspect", str(changed), cache=cache)
    assert refused.returncode == 1
    assert "would import module usernets" in refused.stderr and "--arch usernets:GrayNet" in refused.stderr
    assert _fresh_process("inspect", str(copy), cache=tmp_path / "other-user").returncode == 1


def test_a_missing_dataset_fails_before_any_pass_runs(runner, tmp_path, monkeypatch):
    started = []
    from optkit.passes.prune import passes

    monkeypatch.setattr(passes.StructuredPrune, "apply", lambda self, model: started.append(1))
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "10", "--prune", "0.3",
                                  "--finetune", f"imagefolder:{tmp_path / 'nowhere'}", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "nowhere" in result.output
    assert started == [] and not (tmp_path / "o" / "model.pt").exists()


def test_a_missing_fashion_mnist_folder_fails_before_any_pass_runs(runner, tmp_path, monkeypatch):
    started = []
    from optkit.passes.prune import passes

    monkeypatch.setattr(passes.StructuredPrune, "apply", lambda self, model: started.append(1))
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "10", "--prune", "0.3",
                                  "--recalibrate-bn", "2", "--calib-data", f"fashion-mnist:{tmp_path}",
                                  "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "not found" in result.output and started == []
