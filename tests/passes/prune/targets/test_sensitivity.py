"""Sensitivity analysis (per-group curves, cache, time budget) and sensitivity allocation to a MACs target."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optkit.model.stats import count_macs
from optkit.passes.prune.graph.groups import Group
from optkit.passes.prune.passes import StructuredPrune
from optkit.passes.prune.targets.curves import Curve, Point, Sensitivity, SensitivitySettings, analyze
from optkit.passes.prune.targets.sensitivity import allocate

DATA = "synthetic:96:3x16x16:4"
SHAPE = (1, 3, 16, 16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4)]
    return nn.Sequential(*layers).eval()


def _settings(**changes) -> SensitivitySettings:
    return SensitivitySettings(**{"data": DATA, "samples": 48, "calibration_samples": 32, "ratios": (0.25, 0.5),
                                  **changes})


def _prune(**changes) -> StructuredPrune:
    return StructuredPrune(**{"ratio": 0.0, "round_to": 8, "input_shape": SHAPE, **changes})


@pytest.mark.parametrize("calibration_samples", [0, 32])
def test_each_group_gets_a_curve_that_matches_an_independent_measurement(calibration_samples):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    result = analyze(model, _settings(calibration_samples=calibration_samples), _prune())
    assert sorted(c.pattern for c in result.curves) == ["0", "3", "6"]  # the three conv outputs (not the classifier)
    assert not result.unmeasured
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    curve = next(c for c in result.curves if c.pattern == "3")
    point = next(p for p in curve.points if p.ratio == 0.5)
    assert point.kept == 16
    # Independently: prune that one group by hand, recalibrate it (and, for the zero point, a copy of the
    # original) on the first training images, and score KL and agreement against the original on the val images.
    from optkit.data import load_dataset
    from optkit.data.adapt import adapted

    val = adapted(load_dataset(DATA, "val", augment=False), SHAPE)
    images = torch.stack([val[i][0] for i in range(min(48, len(val)))])
    train = adapted(load_dataset(DATA, "train", augment=False), SHAPE)
    calibration = torch.stack([train[i][0] for i in range(calibration_samples)]) if calibration_samples else None
    recalibrated, pruned = copy.deepcopy(model), copy.deepcopy(model)
    StructuredPrune(ratio=0.0, layer_ratios={"3": 0.5}, round_to=8, input_shape=SHAPE)(pruned)
    assert pruned[3].out_channels == 16
    as_pruned = copy.deepcopy(pruned).eval()
    with torch.no_grad():
        for net in (recalibrated, pruned):
            if calibration_samples:
                for bn in (m for m in net.modules() if isinstance(m, nn.BatchNorm2d)):
                    bn.reset_running_stats()
                    bn.momentum = None
                    bn.train()
                net(calibration)
            net.eval()
        expected, logits, zero, stale = model(images), pruned(images), recalibrated(images), as_pruned(images)

    def kl(x):
        return float(F.kl_div(F.log_softmax(x, 1), F.log_softmax(expected, 1), reduction="batchmean", log_target=True))

    assert point.mean_kl == pytest.approx(kl(logits), rel=1e-4, abs=1e-7)
    assert result.baseline["mean_kl"] == pytest.approx(kl(zero), rel=1e-4, abs=1e-7)
    assert (result.baseline["mean_kl"] > 1e-3) == bool(calibration_samples)  # default BN statistics move
    assert result.recalibrated_loss(point) == pytest.approx(max(0.0, kl(logits) - kl(zero)), abs=1e-7)
    assert point.agreement == pytest.approx(float((logits.argmax(1) == expected.argmax(1)).float().mean()))
    assert point.as_pruned_mean_kl == pytest.approx(kl(stale), rel=1e-4, abs=1e-7)
    assert point.as_pruned_agreement == pytest.approx(float((stale.argmax(1) == expected.argmax(1)).float().mean()))
    # The allocation's loss: each state's loss over its total across all points, summed (weight 1 by default).
    points = [p for c in result.curves for p in c.points]
    recalibrated_total = sum(max(0.0, p.mean_kl - result.baseline["mean_kl"]) for p in points) or 1.0
    as_pruned_total = sum(1 - p.as_pruned_agreement for p in points) or 1.0
    assert result.loss(point) == pytest.approx(max(0.0, kl(logits) - kl(zero)) / recalibrated_total
                                               + (1 - point.as_pruned_agreement) / as_pruned_total, rel=1e-4)
    assert point.macs_fraction == pytest.approx(count_macs(pruned, SHAPE) / count_macs(model, SHAPE), abs=1e-6)


def test_a_rerun_reads_every_point_from_the_cache():
    model = _model()
    first = analyze(model, _settings(), _prune())
    second = analyze(model, _settings(), _prune())
    assert first.cost["measured"] == 6 and first.cost["cached"] == 0
    assert second.cost["measured"] == 0 and second.cost["cached"] == 6
    assert second.to_dict()["curves"] == first.to_dict()["curves"]
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed[0].weight.mul_(2)
    assert analyze(changed, _settings(), _prune()).cost["measured"] == 6  # other weights, other cache entry


def test_time_budget_leaves_groups_unmeasured_and_allocation_keeps_them_whole():
    from optkit.passes.prune.targets.sensitivity import search

    model = _model()
    analyze(model, _settings(ratios=(0.5,)), _prune())  # caches one point per group
    result = analyze(model, _settings(ratios=(0.5, 0.75), time_budget_s=1e-9), _prune())
    # The cached points are read; the first point to measure finds the budget spent.
    assert result.cost == {**result.cost, "measured": 0, "cached": 1}
    assert len(result.unmeasured) == 2 and result.curves[0].pattern not in result.unmeasured
    searched = StructuredPrune(target_macs=0.9, allocation="sensitivity", data=DATA, round_to=8, input_shape=SHAPE)
    details = search(searched, model, result).details
    assert set(details["layer_ratios"]) <= {result.curves[0].pattern}
    assert any("time budget" in note for note in details["notes"])


def _synthetic_sensitivity(cheap: list[float], costly: list[float], as_pruned_cheap=(1.0, 1.0, 1.0),
                           as_pruned_costly=(1.0, 1.0, 1.0)) -> tuple[Sensitivity, dict]:
    # Two independent branches: layer a (group A) feeds c, layer b (group B) feeds d.
    specs = {"a": {"in": 3, "out": 32, "macs": 3200, "depthwise": False},
             "b": {"in": 3, "out": 32, "macs": 3200, "depthwise": False},
             "c": {"in": 32, "out": 10, "macs": 320, "depthwise": False},
             "d": {"in": 32, "out": 10, "macs": 320, "depthwise": False}}
    groups = [Group("a", 32, [], ["a"], ["c"]), Group("b", 32, [], ["b"], ["d"])]
    curves = [Curve(name, 32, 0.5, [Point(r, k, 1.0, 0.9, 1.0, loss, 0.9, agreement, 0.0)
                                    for r, k, loss, agreement in zip((0.25, 0.5, 0.75), (24, 16, 8), losses,
                                                                     agreements)])
              for name, losses, agreements in (("a", cheap, as_pruned_cheap), ("b", costly, as_pruned_costly))]
    sensitivity = Sensitivity(curves, groups, {"accuracy": 0.9, "mean_kl": 0.0}, 7040, "kl", {}, [], {})
    return sensitivity, specs


def test_allocation_weighs_the_as_pruned_state_when_asked():
    # Group a is cheap once recalibrated but wrecks the model as pruned; group b the other way round.
    sensitivity, specs = _synthetic_sensitivity([0.01, 0.02, 0.03], [0.02, 0.04, 0.06],
                                                as_pruned_cheap=[0.5, 0.2, 0.1], as_pruned_costly=[1.0, 0.99, 0.98])
    kept, _ = allocate(sensitivity, specs, 0.8, round_to=8)
    assert kept[0] < 32 and kept[1] == 32
    sensitivity.as_pruned_weight = 1.0
    kept, _ = allocate(sensitivity, specs, 0.8, round_to=8)
    assert kept[0] == 32 and kept[1] < 32


def test_allocation_spends_the_target_on_the_cheap_group_first():
    sensitivity, specs = _synthetic_sensitivity([0.01, 0.02, 0.03], [1.0, 2.0, 3.0])
    # Group a at its largest measured ratio (8 kept) saves 2400 + 240 MACs: 4400 / 7040 = 0.625 > 0.6,
    # so b gives one step of 8 channels (800 + 80): 3520 / 7040 = 0.5.
    kept, loss = allocate(sensitivity, specs, 0.6, round_to=8)
    assert kept == [8, 24]
    assert loss == pytest.approx(0.03 + 1.0)
    kept, _ = allocate(sensitivity, specs, 0.8, round_to=8)
    assert kept[1] == 32 and kept[0] < 32


def test_allocation_never_goes_beyond_the_largest_measured_ratio():
    sensitivity, specs = _synthetic_sensitivity([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    kept, _ = allocate(sensitivity, specs, 0.01, round_to=8)
    assert kept == [8, 8]


def test_sensitivity_allocation_reaches_the_macs_target_and_its_ratios_reproduce_it():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    settings = StructuredPrune(target_macs=0.5, allocation="sensitivity", data=DATA, round_to=8, input_shape=SHAPE)
    result = settings.apply(model)
    d = result.details
    assert abs(d["achieved_fraction"] - 0.5) <= 0.02
    assert count_macs(result.model, SHAPE) / count_macs(model, SHAPE) == pytest.approx(d["achieved_fraction"], abs=1e-4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    again = StructuredPrune(ratio=0.0, layer_ratios=d["layer_ratios"], round_to=d["round_to"],
                            input_shape=SHAPE)(copy.deepcopy(model))
    assert count_macs(again, SHAPE) == count_macs(result.model, SHAPE)


@pytest.mark.parametrize("changes, message", [
    ({"target_macs": 0.5}, "needs target_macs"),
    ({"data": DATA}, "needs target_macs"),
])
def test_sensitivity_allocation_needs_a_macs_target_and_data(changes, message):
    with pytest.raises(ValueError, match=message):
        StructuredPrune(allocation="sensitivity", **changes)


def test_ratios_must_be_distinct_fractions():
    with pytest.raises(ValueError, match="ratios"):
        SensitivitySettings(data=DATA, ratios=(0.5, 0.5))
    with pytest.raises(ValueError, match="ratios"):
        SensitivitySettings(data=DATA, ratios=(0.5, 1.0))


def test_accuracy_metric_is_the_drop_with_a_kl_tie_break():
    sensitivity, _ = _synthetic_sensitivity([0.0] * 3, [0.0] * 3)
    sensitivity.metric = "accuracy"
    point = Point(0.5, 16, 0.7, 0.85, 0.9, 0.2, 0.85, 0.9, 0.2)
    assert sensitivity.loss(point) == pytest.approx(0.05 + 1e-3 * 0.2)
    assert sensitivity.loss(Point(0.5, 16, 0.7, 0.95, 0.9, 0.0, 0.95, 0.9, 0.0)) == 0.0


def test_to_dict_is_json_ready():
    result = analyze(_model(), _settings(), _prune())
    data = json.loads(json.dumps(result.to_dict()))
    assert data["cost"]["measured"] == 6 and len(data["curves"]) == 3


def test_spread_moves_the_allocation_towards_an_even_cut():
    sensitivity, specs = _synthetic_sensitivity([0.01, 0.02, 0.03], [1.0, 2.0, 3.0])
    assert allocate(sensitivity, specs, 0.6, round_to=8)[0] == [8, 24]
    # Both groups have the same MACs share: with the penalty alone the cut is even.
    assert allocate(sensitivity, specs, 0.6, round_to=8, spread=1.0)[0] == [16, 16]


def test_losses_among_whole_models_divide_each_state_by_its_total_over_them():
    sensitivity, _ = _synthetic_sensitivity([0.0] * 3, [0.0] * 3)
    sensitivity.as_pruned_weight = 2.0
    # recalibrated KL 0.1 and 0.3 (baseline 0); as-pruned disagreement 0.2 and 0.6
    points = [Point(0.0, 0, 0.5, 0.9, 0.95, 0.1, 0.8, 0.8, 1.0), Point(0.0, 0, 0.5, 0.9, 0.9, 0.3, 0.5, 0.4, 2.0)]
    assert sensitivity.losses_among(points) == pytest.approx([0.1 / 0.4 + 2 * 0.2 / 0.8, 0.3 / 0.4 + 2 * 0.6 / 0.8])


def test_search_keeps_the_allocation_whose_pruned_model_measures_best():
    from optkit.passes.prune.targets.sensitivity import search

    model = _model()
    sensitivity = analyze(model, _settings(ratios=(0.25, 0.5, 0.75)), _prune())
    settings = StructuredPrune(target_macs=0.5, allocation="sensitivity", data=DATA, round_to=8, input_shape=SHAPE)
    details = search(settings, model, sensitivity).details
    candidates = details["candidates"]
    assert len(candidates) >= 2
    # By hand: recalibrated KL above the baseline over its total, plus (weight 1) disagreement as pruned over its total.
    kl = [max(0.0, c["mean_kl"] - sensitivity.baseline["mean_kl"]) for c in candidates]
    disagreement = [1 - c["as_pruned_agreement"] for c in candidates]
    losses = [k / (sum(kl) or 1) + d / (sum(disagreement) or 1) for k, d in zip(kl, disagreement)]
    assert [c["measured_loss"] for c in candidates] == pytest.approx(losses, abs=1e-5)
    assert details["spread"] == candidates[losses.index(min(losses))]["spread"]

    # A scorer that makes the last candidate the best one: the search follows the measurement.
    real_score, calls = sensitivity.score_model, []

    def last_is_best(pruned):
        calls.append(pruned)
        perfect = len(calls) == len(candidates)
        return dataclasses.replace(real_score(pruned), mean_kl=0.0 if perfect else 5.0,
                                   as_pruned_agreement=1.0 if perfect else 0.0)

    sensitivity.score_model = last_is_best
    result = search(settings, model, sensitivity)
    assert result.details["spread"] == candidates[-1]["spread"]
    assert count_macs(result.model, SHAPE) == count_macs(calls[-1], SHAPE)
