"""Bias correction: a prune gives back the mean (and variance share) of the channels it removes.

The models are built so the statistics are known exactly: independent
standard-normal inputs through an orthogonal 1x1 conv stay independent and
normal, so the BatchNorm after it really outputs ``N(beta, gamma^2)`` per
channel and the expected values the correction assumes are the true ones.
The reference is the unpruned model's own output statistics on many
samples, measured with forward hooks, not anything the correction computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optkit.passes.prune.passes import StructuredPrune

SHAPE = (1, 8, 4, 4)


class Block(nn.Module):
    """conv1 (orthogonal 1x1) -> bn1 -> activation -> conv2 (1x1) [-> bn2] -> global mean -> fc."""

    def __init__(self, activation: nn.Module, norm_after: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.conv1 = nn.Conv2d(8, 8, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.act = activation
        self.conv2 = nn.Conv2d(8, 6, 1, bias=not norm_after)
        self.bn2 = nn.BatchNorm2d(6) if norm_after else nn.Identity()
        self.fc = nn.Linear(6, 3)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(8, 8, generator=generator))
            self.conv1.weight.copy_(q[:, :, None, None])
            self.bn1.weight.copy_(torch.rand(8, generator=generator) * 1.5 + 0.5)
            self.bn1.bias.copy_(torch.rand(8, generator=generator) * 2 - 1)
            self.conv2.weight.copy_(torch.randn(6, 8, 1, 1, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))
        return self.fc(y.mean((2, 3)))


def samples() -> torch.Tensor:
    return torch.randn(4096, *SHAPE[1:], generator=torch.Generator().manual_seed(1))


def calibrated(activation: nn.Module, norm_after: bool) -> Block:
    """The block with bn1's running statistics those of its input (mean 0, variance 1) and bn2's measured."""
    model = Block(activation, norm_after).eval()
    if norm_after:
        with torch.no_grad():
            out = model.conv2(model.act(model.bn1(model.conv1(samples()))))
            model.bn2.running_mean.copy_(out.mean((0, 2, 3)))
            model.bn2.running_var.copy_(out.var((0, 2, 3)))
    return model


def statistics(model: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of what the head reads (bn2's output, or conv2's without a norm)."""
    seen = []
    hook = model.bn2.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.no_grad():
            model(samples())
    finally:
        hook.remove()
    return seen[0].mean((0, 2, 3)), seen[0].std((0, 2, 3))


def prune(model: Block, bias_correction: bool) -> Block:
    pruned = copy.deepcopy(model)
    StructuredPrune(ratio=0.5, round_to=1, input_shape=SHAPE, ignored_layers=("conv2",),
                    bias_correction=bias_correction)(pruned)
    assert pruned.conv1.out_channels == 4 and pruned.conv2.in_channels == 4 and pruned.conv2.out_channels == 6
    return pruned.eval()


@pytest.mark.parametrize("activation", [nn.ReLU(), nn.SiLU(), nn.GELU()], ids=["relu", "silu", "gelu"])
def test_batchnorm_after_the_layer_gets_the_removed_mean_and_variance_back(activation):
    model = calibrated(activation, norm_after=True)
    mean, std = statistics(model)
    corrected_mean, corrected_std = statistics(prune(model, bias_correction=True))
    plain_mean, plain_std = statistics(prune(model, bias_correction=False))

    assert (corrected_mean - mean).abs().max() < 0.05
    assert ((corrected_std / std) - 1).abs().max() < 0.05
    # Without the correction the shift is large enough for the check above to mean something.
    assert (plain_mean - mean).abs().max() > 0.3
    assert ((plain_std / std) - 1).abs().max() > 0.1


def test_a_layer_with_a_bias_and_no_batchnorm_gets_the_removed_mean_in_its_bias():
    model = calibrated(nn.ReLU(), norm_after=False)
    mean, _ = statistics(model)
    corrected_mean, _ = statistics(prune(model, bias_correction=True))
    plain_mean, _ = statistics(prune(model, bias_correction=False))

    assert (corrected_mean - mean).abs().max() < 0.05
    assert (plain_mean - mean).abs().max() > 0.3


class Concat(nn.Module):
    """conv2 reads a concatenation (of a BatchNorm branch and the input), whose distribution is not modelled."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 16, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(24, 6, 1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = torch.cat([torch.relu(self.bn1(self.conv1(x))), x], 1)
        return self.fc(self.conv2(y).mean((2, 3)))


def test_an_input_of_unknown_distribution_is_left_as_it_is():
    torch.manual_seed(0)
    model = Concat().eval()
    with torch.no_grad():
        model.bn1.bias.uniform_(-1, 1)
    corrected, plain = copy.deepcopy(model), copy.deepcopy(model)
    settings = dict(ratio=0.5, round_to=1, input_shape=SHAPE, ignored_layers=("conv2",))
    StructuredPrune(bias_correction=True, **settings)(corrected)
    StructuredPrune(bias_correction=False, **settings)(plain)

    assert corrected.conv1.out_channels == 8 and corrected.conv2.in_channels == 16
    assert torch.equal(corrected.conv2.bias, plain.conv2.bias)
