"""Data-free bias correction: give back the mean of the channels a prune removes.

Removing an input channel of a conv/linear layer drops its contribution
``W[:, c] * x_c`` from every output. Its average, ``W[:, c] * E[x_c]``, is
what shifts the layer's outputs away from the statistics the following
BatchNorm was trained with, and that shift (not the lost detail) is most of
what breaks a model straight after pruning. When the removed channel comes
out of a BatchNorm in eval mode, the BatchNorm's affine parameters say how it
is distributed: about ``N(beta, gamma^2)`` per channel, and the sum of two
such branches (a residual add of two BatchNorm outputs) about
``N(beta_1 + beta_2, gamma_1^2 + gamma_2^2)``. Pointwise activations after
that (ReLU, SiLU, GELU, ...) are averaged over the normal by quadrature, and
average pooling, dropout and flattening a 1x1 map keep the mean. The
expected contribution is then subtracted from the running mean of the
BatchNorm that reads the layer's output, whose running variance is also
scaled by the share of it the kept inputs carry (inputs taken as
independent), or, with no such BatchNorm, added to the layer's bias.

The same correction for quantization error is described by Nagel et al.,
"Data-Free Quantization Through Weight Equalization and Bias Correction"
(ICCV 2019). Inputs whose distribution cannot be told this way (a residual
add with an identity branch, a concatenation, a LayerNorm) are left as they
are; recalibrating BatchNorm on data corrects all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_MEAN_PRESERVING = ("AvgPool", "AdaptiveAvgPool", "MeanBackward", "CloneBackward", "NativeDropoutBackward",
                    "AliasBackward", "ContiguousBackward")
_RESHAPES = ("ViewBackward", "ReshapeAliasBackward", "UnsafeViewBackward", "FlattenBackward")
_QUADRATURE_POINTS = 801


def corrections(graph: Any, group: Any) -> list[Correction]:
    """For each layer in ``group`` losing input channels whose distribution is known: what to undo.

    Call it before ``group.prune()``, while the weights still have the removed
    channels; applying the corrections (:func:`apply`) before pruning is safe
    too, as they change biases and BatchNorm statistics only.
    """
    import torch
    from torch import nn

    found = []
    for dep, idxs in group:
        layer = dep.target.module
        if not idxs or not graph.is_in_channel_pruning_fn(dep.handler):
            continue
        if isinstance(layer, nn.modules.conv._ConvNd):
            if layer.groups != 1 or layer.transposed:
                continue
            weight = layer.weight.detach().flatten(2)
        elif isinstance(layer, nn.Linear):
            weight = layer.weight.detach()[:, :, None]
        else:
            continue
        moments = input_moments(graph, layer, weight.shape[1])
        if moments is None:
            continue
        means, variances = moments
        removed = torch.zeros(weight.shape[1], dtype=torch.bool, device=weight.device)
        removed[torch.as_tensor([int(i) for i in idxs], dtype=torch.long, device=weight.device)] = True
        shift = weight.sum(2)[:, removed] @ means[removed].to(weight.dtype)
        ratio = None
        if variances is not None:
            spread = (weight * weight).sum(2) * variances.to(weight.dtype)[None, :]
            total = spread.sum(1)
            ratio = torch.where(total > 0, spread[:, ~removed].sum(1) / total.clamp_min(1e-30), torch.ones_like(total))
        found.append(Correction(layer, shift, ratio))
    return found


@dataclass
class Correction:
    """What removing some of ``layer``'s inputs does to its outputs, on average.

    Attributes:
        layer: the conv/linear layer losing input channels.
        shift: per output, the expected contribution of the removed inputs.
        variance_ratio: per output, the fraction of its variance the kept inputs
            carry (channels taken as independent), or ``None`` when unknown.
    """

    layer: Any
    shift: torch.Tensor
    variance_ratio: torch.Tensor | None


def apply(graph: Any, correction: Correction) -> bool:
    """Undo ``correction`` in the BatchNorm that alone reads the layer's output, or else in the layer's bias.

    The BatchNorm's running mean moves by the shift and, when the variance
    ratio is known, its running variance scales by it.

    Returns:
        whether there was a place to put it.
    """
    import torch

    layer = correction.layer
    with torch.no_grad():
        norm = _single_batchnorm_user(graph, layer)
        if norm is not None:
            norm.running_mean.sub_(correction.shift.to(norm.running_mean.dtype))
            if correction.variance_ratio is not None:
                norm.running_var.mul_(correction.variance_ratio.to(norm.running_var.dtype))
            return True
        if getattr(layer, "bias", None) is not None:
            layer.bias.add_(correction.shift.to(layer.bias.dtype))
            return True
        return False


def input_moments(graph: Any, layer: Any, channels: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per-channel mean and variance (``None`` if unknown) of ``layer``'s input, or ``None`` if the mean is unknown."""
    node = graph.module2node.get(layer)
    if node is None:
        return None
    inputs = [n for n in node.inputs if _op_name(n) != "TBackward"]
    if len(inputs) != 1:
        return None
    moments = _moments(inputs[0])
    if moments is None or moments[0].numel() != channels:
        return None
    return moments


def _moments(node: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    name = _op_name(node)
    if name.startswith(_MEAN_PRESERVING) or name.startswith(_RESHAPES):
        source = _single_input(node)
        moments = None if source is None else _moments(source)
        if moments is None:
            return None
        return moments if name.startswith(_RESHAPES) else (moments[0], None)
    normal = _normal(node)
    if normal is not None:
        return normal[0], normal[1] ** 2
    activation = _activation(node)
    source = _single_input(node)
    if activation is None or source is None:
        return None
    normal = _normal(source)
    if normal is None:
        return None
    return _gaussian_moments(activation, *normal)


def _normal(node: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mean, std) per channel of a BatchNorm output, or of a sum of such outputs."""
    from torch import nn

    module = node.module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.weight is None or module.bias is None:
            return None
        return module.bias.detach().clone(), module.weight.detach().abs()
    if _op_name(node) == "AddBackward" and len(node.inputs) == 2:
        parts = [_normal(n) for n in node.inputs]
        if any(p is None for p in parts) or parts[0][0].shape != parts[1][0].shape:
            return None
        return parts[0][0] + parts[1][0], (parts[0][1] ** 2 + parts[1][1] ** 2).sqrt()
    return None


def _activation(node: Any):
    """The pointwise function an activation node applies, or ``None`` if it is not one."""
    import torch.nn.functional as F

    grad_fn = node.grad_fn
    name = _op_name(node)
    simple = {"ReluBackward": F.relu, "SiluBackward": F.silu, "SigmoidBackward": lambda x: x.sigmoid(),
              "TanhBackward": lambda x: x.tanh(), "HardswishBackward": F.hardswish,
              "HardsigmoidBackward": F.hardsigmoid, "MishBackward": F.mish}
    if name in simple:
        return simple[name]
    if name == "GeluBackward":
        approximate = getattr(grad_fn, "_saved_approximate", "none")
        return lambda x: F.gelu(x, approximate=approximate)
    if name == "HardtanhBackward":
        low, high = float(grad_fn._saved_min_val), float(grad_fn._saved_max_val)
        return lambda x: x.clamp(low, high)
    if name == "LeakyReluBackward":
        slope = float(grad_fn._saved_negative_slope)
        return lambda x: F.leaky_relu(x, slope)
    return None


def _gaussian_moments(function, mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ``function(mean + std * z)`` per channel, ``z ~ N(0, 1)``, on a grid over +-8 std."""
    import torch

    z = torch.linspace(-8.0, 8.0, _QUADRATURE_POINTS, dtype=torch.float64, device=mean.device)
    weights = torch.exp(-0.5 * z * z)
    weights /= weights.sum()
    values = function(mean.double()[None, :] + std.double()[None, :] * z[:, None])
    first = (weights[:, None] * values).sum(0)
    second = (weights[:, None] * values * values).sum(0)
    return first.to(mean.dtype), (second - first * first).clamp_min(0).to(mean.dtype)


def _single_input(node: Any) -> Any:
    return node.inputs[0] if len(node.inputs) == 1 else None


def _single_batchnorm_user(graph: Any, layer: Any) -> Any:
    from torch import nn

    node = graph.module2node.get(layer)
    if node is None or len(node.outputs) != 1:
        return None
    norm = node.outputs[0].module
    if not isinstance(norm, nn.modules.batchnorm._BatchNorm) or norm.running_mean is None:
        return None
    return norm


def _op_name(node: Any) -> str:
    grad_fn = node.grad_fn
    if grad_fn is None or not hasattr(grad_fn, "name"):
        return ""
    name = grad_fn.name()
    return name[:-1] if name[-1:].isdigit() else name

