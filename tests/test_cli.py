"""End-to-end `optkit optimize` / `optkit passes` through the CLI (the foundation's acceptance)."""

import json
import re

import pytest
import torch
from torch import nn

import optkit
from optkit.cli import main


def _optimize(runner, *args):
    return runner.invoke(main, ["optimize", *args], catch_exceptions=False)


def test_resnet18_structured_acceptance(runner, tmp_path):
    out = tmp_path / "D"
    result = _optimize(runner, "torchvision:resnet18", "--prune", "0.3", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "Parameters" in result.output and "MACs" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["after"]["macs"] / report["before"]["macs"] <= 0.55
    assert {"params", "macs", "sparsity"} <= set(report["before"]) and report["passes"][0]["name"] == "structured_prune"
    raw = torch.load(out / "model.pt", weights_only=True)
    assert raw["format"] == "optkit.slimmed"
    model = optkit.load_model(out / "model.pt").eval()
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    assert sum(p.numel() for p in model.parameters()) == report["after"]["params"]
    assert (out / "report.md").read_text().startswith("# optkit report")


ARCHS = ["resnet18", "mobilenet_v2", "efficientnet_b0", "vgg11_bn"]
SMALL = ["--input-shape", "1,3,64,64", "--num-classes", "10"]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "vgg11_bn" else a for a in ARCHS])
def test_structured_prune_then_recipe_reproduces(runner, tmp_path, arch):
    first, second = tmp_path / "first", tmp_path / "second"
    assert _optimize(runner, f"torchvision:{arch}", "--prune", "0.3", *SMALL, "--out", str(first)).exit_code == 0
    report = json.loads((first / "report.json").read_text())
    assert report["after"]["macs"] < 0.75 * report["before"]["macs"]
    result = _optimize(runner, f"torchvision:{arch}", "--num-classes", "10", "--recipe", str(first / "recipe.toml"),
                       "--out", str(second))
    assert result.exit_code == 0, result.output
    again = json.loads((second / "report.json").read_text())
    assert again["after"]["params"] == report["after"]["params"]
    assert again["input_shape"] == [1, 3, 64, 64]


# vgg11_bn's 130 M parameters take a minute here; the other families show the same behaviour in seconds.
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "vgg11_bn" else a for a in ARCHS])
def test_unstructured_prune_sparsity_and_no_reparametrization(runner, tmp_path, arch):
    out = tmp_path / "D"
    result = _optimize(runner, f"torchvision:{arch}", "--prune", "0.3", "--method", "unstructured", *SMALL,
                       "--out", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["after"]["sparsity"] == pytest.approx(0.30, abs=0.01)
    assert report["after"]["params"] == report["before"]["params"]
    assert any("no faster" in note for note in report["notes"])
    raw = torch.load(out / "model.pt", weights_only=True)
    assert not any(k.endswith(("weight_orig", "weight_mask")) for k in raw["state_dict"])
    model = optkit.load_model(out / "model.pt")
    assert all(not m._forward_pre_hooks for m in model.modules())
    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(report["after"]["sparsity"], abs=1e-12)


def test_global_unstructured_is_exact(runner, tmp_path):
    result = _optimize(runner, "torchvision:resnet18", "--prune", "0.5", "--method", "unstructured", "--global",
                       *SMALL, "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "report.json").read_text())["after"]["sparsity"] == pytest.approx(0.5, abs=1e-6)


def test_pickle_with_code_is_refused_and_never_runs(runner, tmp_path):
    marker = tmp_path / "ran"

    class Detonator:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": Detonator()}, tmp_path / "evil.pt")
    result = runner.invoke(main, ["optimize", str(tmp_path / "evil.pt"), "--prune", "0.3", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("Error: ") and "--trust" in result.output
    assert not marker.exists() and not (tmp_path / "o" / "model.pt").exists()


def _one_line_error(result, code=1):
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("ratio", ["1.5", "1", "-0.1", "nan"])
def test_out_of_range_ratio_is_a_usage_error(runner, tmp_path, ratio):
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--prune", ratio, "--out", str(tmp_path / "o")])
    assert "[0, 1)" in _one_line_error(result, code=2)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_text("not a model\n"), "not a PyTorch checkpoint"),
    ],
    ids=["missing", "text"],
)
def test_bad_model_files(runner, tmp_path, make, message):
    path = tmp_path / "model.pt"
    make(path)
    result = runner.invoke(main, ["optimize", str(path), "--prune", "0.3", "--out", str(tmp_path / "o")])
    assert message in _one_line_error(result)


def test_unknown_torchvision_name(runner, tmp_path):
    result = runner.invoke(main, ["optimize", "torchvision:resnet1", "--prune", "0.3", "--out", str(tmp_path / "o")])
    assert "unknown torchvision model 'resnet1'" in _one_line_error(result)


def test_existing_results_need_force(runner, tmp_path):
    args = ["torchvision:resnet18", "--prune", "0.3", *SMALL, "--out", str(tmp_path)]
    assert _optimize(runner, *args).exit_code == 0
    before = (tmp_path / "model.pt").read_bytes()
    assert "--force" in _one_line_error(runner.invoke(main, ["optimize", *args]))
    assert (tmp_path / "model.pt").read_bytes() == before
    assert _optimize(runner, *args, "--force").exit_code == 0


def test_forced_rerun_removes_the_earlier_runs_onnx_file(runner, tmp_path):
    args = ["torchvision:resnet18", "--prune", "0.3", *SMALL, "--no-latency", "--out", str(tmp_path)]
    assert _optimize(runner, *args, "--export", "onnx").exit_code == 0
    assert (tmp_path / "model.onnx").is_file()
    assert _optimize(runner, *args, "--force").exit_code == 0
    assert not (tmp_path / "model.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["channels.png", "model.pt", "recipe.toml", "report.json",
                                                          "report.md"]


def test_an_onnx_file_already_in_the_folder_needs_force(runner, tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"kept")
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", *SMALL, "--out", str(tmp_path)])
    assert "model.onnx" in _one_line_error(result) and "--force" in _one_line_error(result)
    assert (tmp_path / "model.onnx").read_bytes() == b"kept"


def test_nothing_to_do_and_conflicting_flags(runner, tmp_path):
    assert "nothing to do" in _one_line_error(runner.invoke(main, ["optimize", "torchvision:resnet18"]), code=2)
    (tmp_path / "r.toml").write_text('[[pass]]\nname = "l1_unstructured"\n')
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", "--recipe", str(tmp_path / "r.toml")])
    assert "either --recipe" in _one_line_error(result, code=2)


def test_failing_pass_leaves_no_output(runner, tmp_path):
    (tmp_path / "r.toml").write_text('[[pass]]\nname = "structured_prune"\nignored_layers = ["no_such_layer"]\n')
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--recipe", str(tmp_path / "r.toml"),
                                  "--out", str(tmp_path / "o")])
    line = _one_line_error(result)
    assert "pass 'structured_prune' failed" in line and "no_such_layer" in line
    assert not (tmp_path / "o").exists()


def test_wrong_input_shape_names_the_option(runner, tmp_path):
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", "--input-shape", "1,1,64,64",
                                  "--out", str(tmp_path / "o")])
    assert "--input-shape" in _one_line_error(result)


def test_debug_shows_the_traceback(runner, tmp_path):
    result = runner.invoke(main, ["--debug", "optimize", str(tmp_path / "missing.pt"), "--prune", "0.3"])
    assert result.exit_code == 1 and "Traceback" in result.output


def test_passes_lists_names_with_descriptions(runner):
    result = runner.invoke(main, ["passes"])
    assert result.exit_code == 0
    assert re.search(r"^structured_prune +Remove whole channels", result.output, re.M)
    assert "l1_unstructured" in result.output


def test_an_unversioned_recipe_runs_says_it_was_migrated_and_is_saved_as_the_current_version(runner, tmp_path):
    from optkit.core.recipe_versions import VERSION

    old = tmp_path / "old.toml"
    old.write_text('input_shape = [1, 3, 32, 32]\n\n[[pass]]\nname = "l1_unstructured"\nratio = 0.2\n')
    result = _optimize(runner, "torchvision:resnet18", "--num-classes", "10", "--recipe", str(old),
                       "--out", str(tmp_path / "D"))
    assert result.exit_code == 0, result.output
    assert f"note: {old} is a version 1 recipe; it was migrated to version {VERSION}" in result.output
    saved = (tmp_path / "D" / "recipe.toml").read_text()
    assert saved.startswith(f"version = {VERSION}\ninput_shape = [1, 3, 32, 32]\n") and 'name = "l1_unstructured"' in saved


def test_a_newer_recipe_is_a_one_line_error(runner, tmp_path):
    from optkit.core.recipe_versions import VERSION

    new = tmp_path / "new.toml"
    new.write_text(f'version = {VERSION + 1}\n\n[[pass]]\nname = "l1_unstructured"\n')
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--recipe", str(new), "--out", str(tmp_path / "D")])
    assert result.exit_code == 1
    assert result.output == (f"Error: {new} is a version {VERSION + 1} recipe, but this optkit reads recipe versions "
                             f"up to {VERSION}: upgrade optkit to run it\n")
    assert not (tmp_path / "D").exists()
