"""The verified prune: blocks torch-pruning breaks on are held, the rest is pruned, the caller's model is safe."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch_pruning as tp
from torch import nn

from optkit.model.stats import count_macs
from optkit.passes.prune.graph import arch as _arch
from optkit.passes.prune.graph import pruner as _engine
from optkit.passes.prune.graph import fallback as _fallback
from optkit.passes.prune.passes import StructuredPrune

SHAPE = (1, 3, 16, 16)


class FixedHeads(nn.Module):
    """A block whose forward hard-codes its head layout (4 heads of 8 channels), as some attention code does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(16, 32, 1)
        self.out = nn.Conv2d(32, 16, 1)

    def forward(self, x):
        y = self.proj(x)
        b, _, h, w = y.shape
        return x + self.out(y.reshape(b, 4, 8, h, w).softmax(2).reshape(b, 32, h, w))


class Net(nn.Module):
    def __init__(self, block: nn.Module | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 16, 3, padding=1))
        self.block = block if block is not None else FixedHeads()
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = self.block(x + self.body(x))
        return self.head(x.mean((2, 3)))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].shape == value.shape, name
        assert torch.equal(after[name], value), name


def test_fallback_holds_exactly_the_block_that_breaks_and_prunes_the_rest():
    torch.manual_seed(0)
    model = Net()
    macs_before = count_macs(model, SHAPE)
    details = StructuredPrune(input_shape=SHAPE, round_to=8).apply(model).details
    assert list(details["held_layers"]) == ["block.proj"]
    assert "invalid for input of size" in details["held_layers"]["block.proj"]
    assert model.block.proj.out_channels == 32  # held: its head layout is hard-coded
    assert model.body[0].out_channels < 64 and model.stem.out_channels < 16  # the rest is pruned
    assert details["fallback"]["trials"] > 1 and details["fallback"]["seconds"] >= 0
    assert details["shortfall"].startswith("asked 0.3 per group, achieved MACs ")
    assert count_macs(model, SHAPE) / macs_before < 0.75
    out = model(torch.randn(2, *SHAPE[1:]))
    assert out.shape == (2, 10)
    out.sum().backward()


def test_a_model_that_prunes_cleanly_needs_one_trial_and_no_shortfall():
    torch.manual_seed(0)
    model = Net(block=nn.Identity())
    details = StructuredPrune(input_shape=SHAPE).apply(model).details
    assert details["fallback"] == {"trials": 1, "seconds": 0.0}
    assert "shortfall" not in details and "held_layers" not in details


def test_callers_model_is_unchanged_when_pruning_fails_midway(monkeypatch):
    torch.manual_seed(0)
    model = Net(block=nn.Identity())
    before, ids = snapshot(model), [id(m) for m in model.modules()]

    def prune_then_fail(plan, *args):
        real_run_plan(plan, *args)
        raise RuntimeError("injected failure after the copy was pruned")

    real_run_plan = _engine.run_plan
    monkeypatch.setattr(_engine, "run_plan", prune_then_fail)
    details = StructuredPrune(input_shape=SHAPE, fallback_trials=3).apply(model).details
    assert "injected failure" in details["shortfall"] and "unchanged" in details["shortfall"]
    assert details["pruned_layers"] == 0
    assert_unchanged(model, before)
    assert [id(m) for m in model.modules()] == ids


def test_callers_model_is_unchanged_when_the_pass_raises():
    torch.manual_seed(0)
    model = Net()
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        StructuredPrune(input_shape=(1, 5, 16, 16)).apply(model)  # the model does not run at this shape
    assert_unchanged(model, before)


def test_a_hanging_group_is_held_and_the_run_goes_on(monkeypatch):
    """A dependency group that never finishes building is held after the per-group limit; the rest is pruned."""
    torch.manual_seed(0)
    model = Net(block=nn.Sequential(nn.Conv2d(16, 48, 1), nn.ReLU(), nn.Conv2d(48, 16, 1)))
    real = tp.DependencyGraph.get_pruning_group

    def loops_on_the_block(self, module, *args, **kwargs):
        if isinstance(module, nn.Conv2d) and module.out_channels == 48:
            while True:  # what torch-pruning's index mapping does on some graphs
                pass
        return real(self, module, *args, **kwargs)

    monkeypatch.setattr(tp.DependencyGraph, "get_pruning_group", loops_on_the_block)
    start = time.monotonic()
    details = StructuredPrune(input_shape=SHAPE, group_timeout_s=0.3).apply(model).details
    assert time.monotonic() - start < 30
    assert list(details["held_layers"]) == ["block.0"]
    assert "did not finish within 0.3 s" in details["held_layers"]["block.0"]
    assert model.block[0].out_channels == 48 and model.body[0].out_channels < 64
    assert model(torch.randn(1, *SHAPE[1:])).shape == (1, 10)


def test_search_budget_holds_untested_groups():
    torch.manual_seed(0)
    model = Net()
    details = StructuredPrune(input_shape=SHAPE, fallback_trials=1).apply(model).details
    assert any("ran out of its budget" in reason for reason in details["held_layers"].values())
    assert model(torch.randn(1, *SHAPE[1:])).shape == (1, 10)


def test_channels_first_parameter_is_pruned_along_its_channels():
    class PosEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 24, 1)
            self.pos = nn.Parameter(torch.randn(1, 24, 5, 5))
            self.scale = nn.Parameter(torch.ones(24))
            self.head = nn.Linear(24, 10)

        def forward(self, x):
            x = (self.conv(x) + self.pos) * self.scale[:, None, None]
            return self.head(x.mean((2, 3)))

    model = PosEmbed()
    dims = {tuple(p.shape): dim for p, dim in _arch.unwrapped_parameters(model)}
    assert dims == {(1, 24, 5, 5): 1, (24,): 0}
    StructuredPrune(input_shape=(1, 3, 5, 5)).apply(model)
    assert model.pos.shape == (1, 16, 5, 5) and model.scale.shape == (16,)
    assert model(torch.randn(1, 3, 5, 5)).shape == (1, 10)


def test_attention_found_by_structure_gets_its_head_dim_written_back():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    found = _arch.find_attention(model)
    assert [a.module for a in found] == [block.attn for block in model.blocks]
    details = StructuredPrune(input_shape=(1, 3, 32, 32)).apply(model).details
    assert "held_layers" not in details
    attn = model.blocks[0].attn
    assert attn.head_dim < 64 and attn.qkv.out_features == 3 * attn.num_heads * attn.head_dim
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)


def test_check_runs_reports_a_changed_output_shape():
    model = nn.Linear(4, 3)
    x = torch.randn(1, 4)
    assert _fallback.check_runs(model, x, [(1, 3)]) is None
    assert "output shapes changed" in _fallback.check_runs(model, x, [(1, 2)])


class PartialConv(nn.Module):
    """A conv on the first part of a channel split, concatenated back with the untouched rest."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.partial = nn.Conv2d(8, 8, 3, padding=1)
        self.mix = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        x1, x2 = torch.split(x, [8, 24], dim=1)
        x = self.mix(torch.cat((self.partial(x1), x2), 1))
        return self.head(x.mean((2, 3)))


def test_concat_widths_are_read_from_the_traced_graph():
    from optkit.passes.prune.graph import tp_fixes as _tp_fixes

    def concat_sizes(context):
        model = PartialConv().eval()
        with context:
            graph = tp.DependencyGraph().build_dependency(model, example_inputs=torch.randn(*SHAPE))
        return [node.module.concat_sizes for node in graph.module2node.values() if node.type == tp.ops.OPTYPE.CONCAT]

    assert concat_sizes(_tp_fixes.concat_sizes_from_autograd()) == [[8, 24]]
    # torch-pruning on its own walks from the split's second part back to its first (and then fails to prune).
    assert concat_sizes(contextlib.nullcontext()) == [[8, 8]]


def test_an_int_attribute_holding_a_child_width_follows_it():
    class PixelEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_dim = 32
            self.proj = nn.Conv2d(3, self.in_dim, 3, padding=1)

        def forward(self, x):
            return self.proj(x).reshape(x.shape[0], self.in_dim, -1).transpose(1, 2)

    model = nn.Sequential(PixelEmbed(), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    [attribute] = _arch.arch_support(model, torch.randn(*SHAPE)).widths
    assert (attribute.module, attribute.name, attribute.layer) == (model[0], "in_dim", model[0].proj)
    details = StructuredPrune(input_shape=SHAPE).apply(model).details
    assert "held_layers" not in details
    assert model[0].proj.out_channels == model[0].in_dim == 16 and model[1].in_features == 16
    assert model(torch.randn(2, *SHAPE[1:])).shape == (2, 256, 10)


class RepeatedHeads(nn.Module):
    """``count`` FixedHeads blocks in a row, as real models repeat blocks; every one of them breaks the same way."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 48, 3, padding=1), nn.ReLU(), nn.Conv2d(48, 16, 3, padding=1))
        self.blocks = nn.Sequential(*[FixedHeads() for _ in range(count)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        return self.head(self.blocks(x + self.body(x)).mean((2, 3)))


@pytest.mark.parametrize("count", [2, 5])
def test_a_repeated_broken_block_is_held_in_every_repeat_at_once(count):
    """The first failure (in blocks.0) holds every group of the same structure, not one repeat per trial.

    Trials: the first try, one with the failing structure (and the residual group that touched blocks.0)
    held, then each held class tried again on its own: 4 however many times the block repeats.
    """
    torch.manual_seed(0)
    model = RepeatedHeads(count)
    details = StructuredPrune(input_shape=SHAPE, round_to=8).apply(model).details
    assert sorted(details["held_layers"]) == [f"blocks.{i}.proj" for i in range(count)]
    assert all("invalid for input of size" in reason for reason in details["held_layers"].values())
    assert details["fallback"]["trials"] == 4
    assert all(block.proj.out_channels == 32 for block in model.blocks)
    # The residual group, held with the failing structure at first, is given back and pruned.
    assert model.stem.out_channels == 8 and all(block.out.out_channels == 8 for block in model.blocks)
    assert model.body[0].out_channels < 48
    out = model(torch.randn(2, *SHAPE[1:]))
    assert out.shape == (2, 10)
    out.sum().backward()


def test_repeats_held_at_once_leave_a_tight_budget_for_giving_back_what_only_touched_them():
    """With 4 trials, holding all repeats in one step leaves room to release the residual group (then pruned)."""
    torch.manual_seed(0)
    model = RepeatedHeads(3)
    details = StructuredPrune(input_shape=SHAPE, round_to=8, fallback_trials=4).apply(model).details
    assert sorted(details["held_layers"]) == ["blocks.0.proj", "blocks.1.proj", "blocks.2.proj"]
    assert details["fallback"]["trials"] == 4
    assert model.stem.out_channels == 8 and model.blocks[2].out.out_channels == 8


class Pair(nn.Module):
    """Two 1x1 convs the parent model calls one by one (the block has no forward of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(16, 24, 1)
        self.reduce = nn.Conv2d(24, 16, 1)


class TopLevelHeads(nn.Module):
    """Repeated blocks whose head layout (4 heads of 6) is hard-coded in the top-level forward.

    The error is raised in the model's own forward, so it points at no sub-module and the fallback
    has to find the failing groups by splitting the candidates in halves.
    """

    def __init__(self, count: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 48, 3, padding=1), nn.ReLU(), nn.Conv2d(48, 16, 3, padding=1))
        self.blocks = nn.ModuleList([Pair() for _ in range(count)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.body(x)
        for block in self.blocks:
            y = block.expand(x)
            n, _, h, w = y.shape
            x = x + block.reduce(y.reshape(n, 4, 6, h, w).softmax(2).reshape(n, 24, h, w))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize(("count", "trials"), [(3, 5), (6, 6)])
def test_an_error_pointing_nowhere_is_bisected_and_the_first_culprit_holds_its_repeats(count, trials):
    """The halving search finds blocks.0.expand; its repeats are held for its error without a trial each."""
    torch.manual_seed(0)
    model = TopLevelHeads(count)
    details = StructuredPrune(input_shape=SHAPE, round_to=8).apply(model).details
    held = details["held_layers"]
    assert sorted(held) == [f"blocks.{i}.expand" for i in range(count)]
    assert held["blocks.0.expand"].startswith("RuntimeError: shape '[1, 4, 6, 16, 16]' is invalid")
    for i in range(1, count):
        assert held[f"blocks.{i}.expand"].startswith("same structure as blocks.0.expand, which caused: RuntimeError")
    # 1 first try + the halving down to blocks.0.expand; a trial per repeat would take at least count + 2.
    assert details["fallback"]["trials"] == trials
    assert all(block.expand.out_channels == 24 for block in model.blocks)
    assert model.stem.out_channels == 8 and model.body[0].out_channels < 48
    assert all(block.reduce.out_channels == 8 for block in model.blocks)
    assert model(torch.randn(2, *SHAPE[1:])).shape == (2, 10)
