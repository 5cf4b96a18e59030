"""The greedy channel allocator shared by the latency target and sensitivity allocation."""

from __future__ import annotations

import pytest
from torch import nn

from optkit.passes.prune.targets.allocation import shrink
from optkit.passes.prune.graph.groups import Group, layer_widths, ratios_for
from optkit.passes.prune.passes import StructuredPrune

# Two independent layers: "big" costs 10 per output channel, "small" 1; 32 channels each.
GROUPS = [Group("big", 32, [], ["big"], []), Group("small", 32, [], ["small"], [])]
FULL = {"big": (3, 32), "small": (3, 32)}
PER_CHANNEL = {"big": 10.0, "small": 1.0}


def _cost(name: str, cin: int, cout: int) -> float:
    return PER_CHANNEL[name] * cout


def _loss(per_channel: tuple[float, float]):
    return lambda i, kept: per_channel[i] * (32 - kept)


def test_the_cheapest_loss_per_cost_goes_first():
    # big loses 0.001 per channel for 10 cost (1e-4 per unit), small 0.01 per unit: big goes first.
    kept = shrink(GROUPS, FULL, _cost, 352 - 160, round_to=8, loss=_loss((0.001, 0.01)))
    assert kept == [16, 32]  # two steps of 8 big channels save exactly 160


def test_slack_replaces_a_coarse_last_step_by_small_ones():
    # From 352 to 330: one big step (80) overshoots to 272; three small steps (8 each) reach 328.
    assert shrink(GROUPS, FULL, _cost, 330, round_to=8, loss=_loss((0.001, 0.01))) == [24, 32]
    assert shrink(GROUPS, FULL, _cost, 330, round_to=8, loss=_loss((0.001, 0.01)), slack=5) == [32, 8]


def test_slack_keeps_the_greedy_result_when_small_steps_cannot_land_within_it():
    # 352 -> 300: small steps can save at most 24 (floor 8 channels), so the big step stays.
    assert shrink(GROUPS, FULL, _cost, 300, round_to=8, loss=_loss((0.001, 0.01)), slack=5) == [24, 32]


def test_max_removed_caps_each_group():
    kept = shrink(GROUPS, FULL, _cost, 0, round_to=8, loss=_loss((0.0, 0.0)), max_removed=[0.5, 0.25])
    assert kept == [16, 24]


def test_widths_follow_the_kept_counts():
    groups = [Group("a", 32, [], ["a"], ["c"])]
    widths = layer_widths({"a": (3, 32), "c": (64, 10)}, groups, [8])
    assert widths == {"a": (3, 8), "c": (16, 10)}  # c holds two copies of a's channels (a concatenation)


@pytest.mark.parametrize("keep, round_to", [(9, 1), (20, 4), (8, 8), (24, 8), (31, 1)])
def test_ratios_make_structured_prune_keep_exactly_the_counts(keep, round_to):
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 16, 3), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 2))
    ratios = ratios_for([Group("0", 32, [], [], [])], [keep])
    StructuredPrune(ratio=0.0, layer_ratios=ratios, round_to=round_to, input_shape=(1, 3, 16, 16))(model)
    assert model[0].out_channels == keep and model[2].in_channels == keep
