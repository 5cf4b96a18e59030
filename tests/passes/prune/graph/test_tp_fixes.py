"""torch-pruning's dependency groups are built in bounded time, with progress shown (issue #41: a FocalNet's prune
ran silent for more than ten minutes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optkit.core import progress as progress_module
from optkit.core.progress import show_progress
from optkit.passes.prune.graph import limits
from optkit.passes.prune.graph.tp_fixes import GroupDoesNotConverge, converging_groups
from optkit.passes.prune.passes import StructuredPrune

tp = pytest.importorskip("torch_pruning")


class Modulation(nn.Module):
    """FocalNet's focal modulation, reduced: one projection split into a query, a context and per-level gates;
    each level's context, weighted by its gate (a one-channel slice broadcast over the channels), is summed."""

    def __init__(self, channels: int = 8, levels: int = 2) -> None:
        super().__init__()
        self.levels = levels
        self.project_in = nn.Linear(channels, 2 * channels + levels + 1)
        self.focal = nn.ModuleList(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels,
                                                           bias=False), nn.GELU()) for _ in range(levels))
        self.context = nn.Conv2d(channels, channels, 1)
        self.project_out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # N, H, W, C
        c = x.shape[-1]
        q, ctx, gates = torch.split(self.project_in(x).permute(0, 3, 1, 2), (c, c, self.levels + 1), 1)
        total = 0
        for level, focal in enumerate(self.focal):
            ctx = focal(ctx)
            total = total + ctx * gates[:, level:level + 1]
        total = total + nn.functional.gelu(ctx.mean((2, 3), keepdim=True)) * gates[:, self.levels:]
        return x + self.project_out((q * self.context(total)).permute(0, 2, 3, 1))


class FocalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 8)
        self.modulation = Modulation()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.modulation(self.stem(x.permute(0, 2, 3, 1)))
        return self.head((x + self.mlp(x)).mean((1, 2)))


def _model() -> FocalNet:
    torch.manual_seed(0)
    return FocalNet().eval()


def test_a_group_whose_walk_shifts_its_indices_forever_fails_at_once_and_the_others_are_listed():
    """Around the gates' slice the walk's indices shift every time round, so torch-pruning never finishes the
    group of the modulation's input projection; here it fails fast, and listing every group leaves it out."""
    model = _model()
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=torch.randn(1, 3, 8, 8))
    project_in = model.modulation.project_in
    with limits.time_limit(60), converging_groups():
        with pytest.raises(GroupDoesNotConverge):
            graph.get_pruning_group(project_in, tp.prune_linear_out_channels, list(range(19)))
        roots = {group[0].dep.target.module for group in graph.get_all_groups()}
    assert model.mlp[0] in roots and project_in not in roots


def test_a_focalnet_like_prune_finishes_shows_progress_and_says_what_it_held(monkeypatch):
    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.0)
    model = _model()
    lines: list[str] = []

    with limits.time_limit(120), show_progress(lines.append):
        result = StructuredPrune(ratio=0.5, input_shape=(1, 3, 8, 8), round_to=1).apply(model)

    assert any("dependency groups built" in line for line in lines)
    assert model.mlp[0].out_features == 16  # the MLP's channels, which torch-pruning can group, are pruned
    reasons = result.details["skipped_layers"]
    assert "does not converge" in reasons["modulation.project_in"]
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 4)
