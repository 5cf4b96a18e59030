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
import math

import numpy as np
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


class ResidualOfTwoNorms(nn.Module):
    """conv2 (3x3, no padding) -> bn2 reads ``act(bn_a(conv_a(x)) + bn_b(conv_b(x)))``.

    conv_a and conv_b are orthogonal maps of disjoint halves of the 16 input channels, so with
    standard-normal inputs the two BatchNorm branches are independent normals and their sum is
    really ``N(beta_a + beta_b, gamma_a^2 + gamma_b^2)`` per channel.
    """

    def __init__(self, activation: nn.Module) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(4)
        self.conv_a = nn.Conv2d(16, 8, 1, bias=False)
        self.conv_b = nn.Conv2d(16, 8, 1, bias=False)
        self.bn_a = nn.BatchNorm2d(8)
        self.bn_b = nn.BatchNorm2d(8)
        self.act = activation
        self.conv2 = nn.Conv2d(8, 6, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)
        with torch.no_grad():
            for conv, half in ((self.conv_a, slice(0, 8)), (self.conv_b, slice(8, 16))):
                q, _ = torch.linalg.qr(torch.randn(8, 8, generator=generator))
                conv.weight.zero_()
                conv.weight[:, half, 0, 0] = q
            # Unequal gammas in the two branches, so sqrt(a^2 + b^2) and a + b differ by channel-dependent amounts.
            self.bn_a.weight.copy_(torch.rand(8, generator=generator) * 1.5 + 0.3)
            self.bn_b.weight.copy_(torch.rand(8, generator=generator) * 1.5 + 0.3)
            self.bn_a.bias.copy_(torch.rand(8, generator=generator) * 2 - 1)
            self.bn_b.bias.copy_(torch.rand(8, generator=generator) * 2 - 0.5)
            self.conv2.weight.copy_(torch.randn(6, 8, 3, 3, generator=generator) * 0.3)

    def branches(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.bn_a(self.conv_a(x)) + self.bn_b(self.conv_b(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn2(self.branches(x)).mean((2, 3)))


RESIDUAL_SHAPE = (1, 16, 6, 6)


def _normal_cdf(a: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))


def _relu_normal_moments(mu: np.ndarray, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of relu(N(mu, sigma^2)), closed form."""
    a = mu / sigma
    pdf = np.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    cdf = _normal_cdf(a)
    mean = mu * cdf + sigma * pdf
    return mean, (mu * mu + sigma * sigma) * cdf + mu * sigma * pdf - mean * mean


def _expected_input_moments(model: ResidualOfTwoNorms, relu: bool) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of conv2's input channels, from the closed forms of a normal (and of a rectified normal)."""
    mu = (model.bn_a.bias + model.bn_b.bias).detach().double().numpy()
    sigma = np.sqrt(model.bn_a.weight.detach().double().numpy() ** 2 + model.bn_b.weight.detach().double().numpy() ** 2)
    return _relu_normal_moments(mu, sigma) if relu else (mu, sigma ** 2)


@pytest.mark.parametrize("activation", [nn.Identity(), nn.ReLU()], ids=["plain-sum", "relu"])
def test_a_residual_of_two_batchnorms_corrects_bn2_as_a_sum_of_independent_normals(activation):
    """Guards the variance of ``bn_a + bn_b``: gamma_a^2 + gamma_b^2, not (gamma_a + gamma_b)^2.

    The expected running statistics of bn2 are computed here with numpy from the closed forms, the
    3x3 kernel summed over its positions (the mean) and squared (the variance share).
    """
    relu = isinstance(activation, nn.ReLU)
    model = ResidualOfTwoNorms(activation).eval()
    with torch.no_grad():
        model.bn2.running_mean.copy_(torch.tensor([0.3, -0.2, 1.0, 0.0, -1.5, 0.7]))
        model.bn2.running_var.copy_(torch.tensor([2.0, 0.5, 1.0, 3.0, 1.5, 0.8]))
    pruned = copy.deepcopy(model)
    StructuredPrune(ratio=0.5, round_to=1, input_shape=RESIDUAL_SHAPE, ignored_layers=("conv2",),
                    bias_correction=True)(pruned)
    assert pruned.conv2.in_channels == 4 and pruned.bn_a.num_features == 4 and pruned.bn_b.num_features == 4

    # Which of conv2's input channels were kept: match the pruned branch parameters against the original's.
    original = torch.stack([model.bn_a.weight, model.bn_a.bias, model.bn_b.weight, model.bn_b.bias]).detach()
    left = torch.stack([pruned.bn_a.weight, pruned.bn_a.bias, pruned.bn_b.weight, pruned.bn_b.bias]).detach()
    kept = [int((original - left[:, j:j + 1]).abs().sum(0).argmin()) for j in range(4)]
    assert torch.equal(original[:, kept], left)
    removed = np.array([c not in kept for c in range(8)])

    mean, var = _expected_input_moments(model, relu)
    weight = model.conv2.weight.detach().double().numpy().reshape(6, 8, 9)
    shift = weight.sum(2)[:, removed] @ mean[removed]
    spread = (weight ** 2).sum(2) * var[None, :]
    ratio = spread[:, ~removed].sum(1) / spread.sum(1)
    expected_mean = model.bn2.running_mean.double().numpy() - shift
    expected_var = model.bn2.running_var.double().numpy() * ratio

    assert np.abs(shift).max() > 0.3 and ratio.max() < 0.8  # large enough for the checks below to mean something
    np.testing.assert_allclose(pruned.bn2.running_mean.double().numpy(), expected_mean, rtol=0, atol=2e-4)
    np.testing.assert_allclose(pruned.bn2.running_var.double().numpy(), expected_var, rtol=1e-3, atol=0)


def test_a_residual_of_two_batchnorms_keeps_bn2_output_statistics_on_samples():
    """End to end: with bn2 calibrated on samples, the corrected prune leaves bn2's output near N(0, 1) per channel."""
    model = ResidualOfTwoNorms(nn.ReLU()).eval()
    x = torch.randn(4096, *RESIDUAL_SHAPE[1:], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.branches(x)
        model.bn2.running_mean.copy_(out.mean((0, 2, 3)))
        model.bn2.running_var.copy_(out.var((0, 2, 3)))
    settings = dict(ratio=0.5, round_to=1, input_shape=RESIDUAL_SHAPE, ignored_layers=("conv2",))
    corrected, plain = copy.deepcopy(model), copy.deepcopy(model)
    StructuredPrune(bias_correction=True, **settings)(corrected)
    StructuredPrune(bias_correction=False, **settings)(plain)

    def bn2_output(m):
        with torch.no_grad():
            y = m.bn2(m.branches(x))
        return y.mean((0, 2, 3)), y.std((0, 2, 3))

    mean, std = bn2_output(corrected)
    assert mean.abs().max() < 0.05 and (std - 1).abs().max() < 0.05
    plain_mean, plain_std = bn2_output(plain)
    assert plain_mean.abs().max() > 0.3 and (plain_std - 1).abs().max() > 0.1


class LinearHead(nn.Module):
    """bn1 -> ReLU [-> global average pool -> flatten] -> fc1 (Linear) -> BatchNorm1d -> fc2."""

    def __init__(self, pooled: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(6)
        self.pooled = pooled
        self.first = nn.Conv2d(8, 8, 1, bias=False) if pooled else nn.Linear(8, 8, bias=False)
        self.bn1 = nn.BatchNorm2d(8) if pooled else nn.BatchNorm1d(8)
        self.fc1 = nn.Linear(8, 6)
        self.bn_fc = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)
        with torch.no_grad():
            self.bn1.weight.copy_(torch.rand(8, generator=generator) * 1.5 + 0.5)
            self.bn1.bias.copy_(torch.rand(8, generator=generator) * 2 - 0.5)
            self.fc1.weight.copy_(torch.randn(6, 8, generator=generator) * 0.5)
            self.bn_fc.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0, 0.0, 2.0, -1.0]))
            self.bn_fc.running_var.copy_(torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0, 0.7]))

    def forward(self, x):
        y = torch.relu(self.bn1(self.first(x)))
        if self.pooled:
            y = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.fc2(self.bn_fc(self.fc1(y)))


@pytest.mark.parametrize("pooled", [False, True], ids=["features", "pooled"])
def test_a_linear_layer_gets_the_removed_mean_back_and_the_variance_only_where_it_is_known(pooled):
    """Guards the Linear path, and that averaging over space keeps the mean but not the variance.

    After a global average pool the channels' variance is no longer the BatchNorm's (it shrinks with the
    positions averaged), so the BatchNorm after fc1 keeps its running variance; on features read
    straight from bn1 it is scaled by the share of variance the kept inputs carry.
    """
    model = LinearHead(pooled).eval()
    pruned = copy.deepcopy(model)
    shape = (1, 8, 4, 4) if pooled else (1, 8)
    StructuredPrune(ratio=0.5, round_to=1, input_shape=shape, ignored_layers=("fc1",), bias_correction=True)(pruned)
    assert pruned.fc1.in_features == 4 and pruned.fc1.out_features == 6

    original = torch.stack([model.bn1.weight, model.bn1.bias]).detach()
    left = torch.stack([pruned.bn1.weight, pruned.bn1.bias]).detach()
    kept = [int((original - left[:, j:j + 1]).abs().sum(0).argmin()) for j in range(4)]
    assert torch.equal(original[:, kept], left)
    removed = np.array([c not in kept for c in range(8)])

    mean, var = _relu_normal_moments(model.bn1.bias.detach().double().numpy(),
                                     model.bn1.weight.detach().abs().double().numpy())
    weight = model.fc1.weight.detach().double().numpy()
    expected_mean = model.bn_fc.running_mean.double().numpy() - weight[:, removed] @ mean[removed]
    spread = weight ** 2 * var[None, :]
    ratio = np.ones(6) if pooled else spread[:, ~removed].sum(1) / spread.sum(1)
    expected_var = model.bn_fc.running_var.double().numpy() * ratio

    assert np.abs(weight[:, removed] @ mean[removed]).max() > 0.3
    np.testing.assert_allclose(pruned.bn_fc.running_mean.double().numpy(), expected_mean, rtol=0, atol=2e-4)
    np.testing.assert_allclose(pruned.bn_fc.running_var.double().numpy(), expected_var, rtol=1e-3, atol=0)
    assert pooled or ratio.max() < 0.9  # the scaled variance differs from the unscaled one


class IdentityResidual(nn.Module):
    """conv2 reads ``relu(bn1(conv1(s)) + s)``, ``s = stem(x)``: the identity branch's distribution is not modelled."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(8, 8, 1)
        self.conv1 = nn.Conv2d(8, 8, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        s = self.stem(x)
        return self.fc(self.conv2(torch.relu(self.bn1(self.conv1(s)) + s)).mean((2, 3)))


def test_a_residual_add_with_an_identity_branch_is_left_as_it_is():
    """Only a sum of BatchNorm outputs has a known distribution; one BatchNorm plus a conv's output does not."""
    torch.manual_seed(0)
    model = IdentityResidual().eval()
    with torch.no_grad():
        model.bn1.bias.uniform_(0.5, 1.5)  # a large mean, which a wrong correction would move the bias by
    settings = dict(ratio=0.5, round_to=1, input_shape=SHAPE, ignored_layers=("conv2",))
    corrected, plain = copy.deepcopy(model), copy.deepcopy(model)
    StructuredPrune(bias_correction=True, **settings)(corrected)
    StructuredPrune(bias_correction=False, **settings)(plain)
    assert corrected.conv2.in_channels == plain.conv2.in_channels == 4
    assert torch.equal(corrected.conv2.bias, plain.conv2.bias)
