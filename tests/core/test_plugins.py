"""Passes from outside optkit: an installed package's entry point, @register_pass, and plain callables."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.cli import main
from optkit.core.contract import Pass, PassResult
from optkit.core.errors import PassError, RecipeError
from optkit.core.pipeline import Pipeline
from optkit.core.registry import get_pass, list_passes, register_pass
from optkit.core.settings import setting

PLUGIN_PASS = "clamp_weights"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _max_weight(model: nn.Module) -> float:
    return max(float(m.weight.detach().abs().max()) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


def test_the_installed_plugin_pass_is_listed_without_importing_torch_or_the_plugin():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom optkit.cli import main\n"
            "r = CliRunner().invoke(main, ['passes'])\nprint(r.output)\n"
            "print('torch' in sys.modules, 'optkit_example_plugin.passes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{PLUGIN_PASS}" in out and "Clamp every conv/linear weight" in out
    assert out.strip().splitlines()[-1] == "False False"


def test_the_plugin_pass_runs_from_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'input_shape = [1, 3, 8, 8]\n\n[[pass]]\nname = "{PLUGIN_PASS}"\nlimit = 0.01\n')
    run = Pipeline.load(recipe).run(_net())
    assert _max_weight(run.model) <= 0.01 + 1e-9
    assert run.records[0].name == PLUGIN_PASS and run.records[0].details["clamped_weights"] > 0


def test_the_plugin_pass_runs_from_the_cli_generic_option(tmp_path):
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "4", "--input-shape",
                                       "1,3,32,32", "--pass", f"{PLUGIN_PASS}:limit=0.02", "--out",
                                       str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [p["name"] for p in report["passes"]] == [PLUGIN_PASS]
    assert f'name = "{PLUGIN_PASS}"' in (tmp_path / "o" / "recipe.toml").read_text()
    saved = torch.load(tmp_path / "o" / "model.pt", weights_only=True)
    weights = [t for k, t in saved["state_dict"].items() if k.endswith("weight") and t.dim() in (2, 4)]
    assert weights and max(float(w.abs().max()) for w in weights) <= 0.02 + 1e-7


def test_a_plugin_setting_out_of_range_is_refused_with_its_range():
    with pytest.raises(RecipeError, match=r"limit must be a number > 0"):
        Pipeline.from_toml(f'[[pass]]\nname = "{PLUGIN_PASS}"\nlimit = 0\n')


def test_a_plain_function_runs_in_a_pipeline_with_its_own_record():
    def halve_weights(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        return model

    model = _net()
    before = _max_weight(model)
    run = Pipeline([get_pass("l1_unstructured")(ratio=0.5), halve_weights], input_shape=(1, 3, 8, 8)).run(model)
    assert [r.name for r in run.records] == ["l1_unstructured", "halve_weights"]
    record = run.records[1]
    assert record.seconds >= 0 and record.stats is not None and record.stats.params == run.before.params
    assert _max_weight(run.model) == pytest.approx(before * 0.5, rel=1e-6)
    zeros = sum(int((m.weight == 0).sum()) for m in run.model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    total = sum(m.weight.numel() for m in run.model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    assert record.stats.sparsity == pytest.approx(zeros / total, abs=1e-9)


def test_saving_a_pipeline_with_a_plain_function_names_the_step():
    pipeline = Pipeline([get_pass("l1_unstructured")(), lambda m: m])
    with pytest.raises(RecipeError, match=r"step 2 \(<lambda>\) is a plain callable and has no recipe form"):
        pipeline.to_toml()


def test_a_failing_function_is_named_with_the_passes_before_it():
    def explode(model):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"pass 'explode' failed \(passes completed before it: l1_unstructured\): boom"):
        Pipeline([get_pass("l1_unstructured")(), explode], input_shape=(1, 3, 8, 8)).run(_net())


def test_a_function_that_returns_nothing_is_an_error():
    with pytest.raises(PassError, match="returned NoneType; a pass must return the model"):
        Pipeline([lambda m: None], input_shape=(1, 3, 8, 8)).run(_net())


def test_register_pass_adds_a_class_to_the_registry_and_recipes(monkeypatch):
    from optkit.core import registry

    monkeypatch.setattr(registry, "_registered", dict(registry._registered))

    @register_pass
    @dataclasses.dataclass(frozen=True)
    class AddToBias(Pass):
        """Add a constant to every bias."""

        name = "add_to_bias_test"
        amount: float = setting(1.0, help="What to add.")

        def apply(self, model):
            with torch.no_grad():
                for m in model.modules():
                    if getattr(m, "bias", None) is not None:
                        m.bias.add_(self.amount)
            return PassResult(model)

    assert "add_to_bias_test" in list_passes() and get_pass("add_to_bias_test") is AddToBias
    assert "amount: What to add." in AddToBias.__doc__
    pipeline = Pipeline.from_toml('[[pass]]\nname = "add_to_bias_test"\namount = 2.0\n')
    model = _net()
    bias = model[0].bias.detach().clone()
    out = pipeline.run(model, measure_stats=False).model
    assert torch.allclose(out[0].bias, bias + 2.0)
    assert Pipeline.from_toml(pipeline.to_toml()).passes == pipeline.passes


def test_register_pass_refuses_a_taken_name_and_a_mutable_class():
    @dataclasses.dataclass(frozen=True)
    class Clash(Pass):
        name = "structured_prune"

    with pytest.raises(ValueError, match="already registered by optkit.passes.prune.passes:StructuredPrune"):
        register_pass(Clash)

    class NotADataclass(Pass):
        name = "not_a_dataclass_test"

    with pytest.raises(TypeError, match=r"must be a @dataclass\(frozen=True\)"):
        register_pass(NotADataclass)
