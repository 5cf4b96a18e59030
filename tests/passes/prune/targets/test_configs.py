"""Pruning targets as typed configs: the settings map to one target each, and registered handlers reach them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from optkit.core.contract import PassResult
from optkit.passes.prune.targets import configs as targets
from optkit.passes.prune.graph.channels import prune_to
from optkit.passes.prune.spec import PruneSpec, Widths
from optkit.passes.prune.passes import StructuredPrune
from optkit.passes.prune.targets.curves import Sensitivity

SHAPE = (1, 3, 16, 16)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 4)).eval()


def _widths(model: nn.Module) -> list[int]:
    return [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize(("settings", "expected"), [
    ({"ratio": 0.4, "round_to": 4}, targets.RatioTarget(0.4, 4)),
    ({"target_macs": 0.5, "target_tolerance": 0.02}, targets.MacsTarget(0.5, 0.02, 16)),
    ({"target_params": 0.6, "round_to": 8}, targets.ParamsTarget(0.6, 0.01, 8)),
    ({"target_latency": 0.7, "latency_threads": 2, "latency_batch": 4},
     targets.LatencyTarget(0.7, 0.01, 2, 4, 16)),
    ({"target_latency": 0.7, "round_to": "auto"}, targets.LatencyTarget(0.7, 0.01, None, 1, None)),
])
def test_each_setting_combination_becomes_one_typed_target(settings, expected):
    assert StructuredPrune(**settings).target(_model()) == expected


def test_sensitivity_allocation_takes_curves_given_instead_of_measuring():
    curves = Sensitivity([], [], {"accuracy": 1.0, "mean_kl": 0.0}, 100, "kl", {}, [], {})
    prune = StructuredPrune(target_macs=0.5, allocation="sensitivity", data="synthetic:8", round_to=8)
    assert prune.target(_model(), curves) == targets.SensitivityTarget(0.5, 0.01, 8, curves)


def test_the_spec_carries_how_channels_go_and_widths_say_how_many():
    prune = StructuredPrune(input_shape=SHAPE, importance="l2", allocation="global", iterative_steps=3,
                            layer_ratios={"3": 0.5}, ignored_layers=("0",), timeout_s=7.0)
    spec = prune.spec()
    assert (spec.input_shape, spec.importance, spec.global_, spec.steps, spec.ignored_layers, spec.timeout_s) == (
        SHAPE, "l2", True, 3, ("0",), 7.0)
    # One ratio for every group keeps the user's overrides, ranking and steps; per-group widths replace them.
    assert spec.uniform(0.3, 8) == Widths(0.3, {"3": 0.5}, 8, True, 3)
    assert spec.per_group({"0": 0.25}, 4) == Widths(0.0, {"0": 0.25}, 4, False, 3)
    assert spec.per_group({}, 4, steps=1) == Widths(0.0, None, 4, False, 1)
    assert StructuredPrune().spec().input_shape == (1, 3, 224, 224)


def test_prune_to_keeps_the_per_group_widths_asked():
    model = _model()
    spec = StructuredPrune(input_shape=SHAPE).spec()
    details = prune_to(model, spec, spec.per_group({"0": 0.75 - 1e-9, "3": 0.5 - 1e-9}, 1))
    assert _widths(model) == [8, 16] and model[7].in_features == 16
    assert details["pruned_layers"] == 3 and details["skipped_layers"] == {}
    assert model(torch.randn(2, *SHAPE[1:])).shape == (2, 4)


def test_the_ratio_handler_gives_what_the_pass_gives():
    by_pass = StructuredPrune(ratio=0.5, round_to=4, input_shape=SHAPE).apply(_model())
    spec = StructuredPrune(input_shape=SHAPE).spec()
    by_target = targets.reach(targets.RatioTarget(0.5, 4), spec, _model())
    assert _widths(by_target.model) == _widths(by_pass.model) == [16, 16]
    assert by_target.details["ratio"] == 0.5


def test_a_new_target_is_a_config_and_a_handler(monkeypatch):
    monkeypatch.setattr(targets, "_HANDLERS", dict(targets._HANDLERS))

    @dataclasses.dataclass(frozen=True)
    class Halve:
        pass

    @targets.handles(Halve)
    def halve(target, spec, model):
        return PassResult(model, prune_to(model, spec, spec.uniform(0.5, 1)))

    result = targets.reach(Halve(), PruneSpec(input_shape=SHAPE), _model())
    assert _widths(result.model) == [16, 16]
    with pytest.raises(ValueError, match="Halve already has a handler: .*halve"):
        targets.handles(Halve)(halve)


def test_a_target_without_a_handler_names_the_registered_ones():
    StructuredPrune(input_shape=SHAPE).apply(_model())  # registers the built-in handlers

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        pass

    with pytest.raises(TypeError, match="no handler for the pruning target Unknown; registered: .*MacsTarget"):
        targets.reach(Unknown(), PruneSpec(input_shape=SHAPE), _model())


@pytest.mark.parametrize(("entry", "ratios"), [
    ({"name": "structured_prune", "ratio": 0.5, "iterative_steps": 3, "round_to": 8},
     [1 - 0.5 ** (1 / 3)] * 3),
    ({"name": "structured_prune", "ratio": 0.5}, [0.5]),
    ({"name": "structured_prune", "ratio": 0.5, "iterative_steps": 1}, [0.5]),
])
def test_split_for_training_compounds_to_the_ratio(entry, ratios):
    parts = StructuredPrune.split_for_training(entry)
    assert [p["ratio"] for p in parts] == pytest.approx(ratios, rel=1e-12)
    assert all("iterative_steps" not in p for p in parts) or parts == [entry]
    assert all(p["round_to"] == 8 for p in parts if "round_to" in entry)


def test_a_target_is_not_split_for_training():
    entry = {"name": "structured_prune", "target_macs": 0.5, "iterative_steps": 3}
    assert StructuredPrune.split_for_training(entry) == [entry]
