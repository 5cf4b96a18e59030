"""Folding BatchNorm into the conv or linear layer that feeds it, so it costs nothing at inference.

The engine of the ``fold_batchnorm`` pass (:mod:`optkit.passes.batchnorm`), and
what :func:`optkit.export.onnx.export_onnx` runs on its copy before export.
"Feeds" is decided from the data flow (:mod:`optkit.model.dataflow`), never
from module order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE
from optkit.model.dataflow import DataFlow, data_flow
from optkit.model.inputs import example_input
from optkit.model.state import eval_mode, set_submodule

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["fold_batchnorm"]


def fold_batchnorm(model: nn.Module, *, input_shape: Sequence[int] | None = None) -> dict[str, Any]:
    """Fold every BatchNorm fed only by a conv or linear layer into that layer.

    The layer's weight and bias absorb the BN's eval-mode affine transform and
    the BN is replaced by ``nn.Identity``. A BN is folded only when the data
    flow shows its input comes from exactly that layer and that layer's output
    goes only to it; others (a BN before a conv, as in densenet; a BN after a
    concatenation; a shared layer) are left in place and reported with the reason.

    Folding yields the model's eval-mode function: train the model afterwards
    and it no longer normalizes.

    Args:
        model: the model, changed in place.
        input_shape: example input shape, used when torch.fx cannot trace the
            model and to check that a linear layer's output is 2-D.

    Returns:
        details: ``folded`` (``{bn name: layer name}``), ``not_folded``
        (``{bn name: reason}``) and ``dataflow``.

    Raises:
        ValueError: if the data flow cannot be found.
    """
    import torch
    from torch import nn

    flow = data_flow(model, _example(model, input_shape))
    modules = dict(model.named_modules())
    pairs: dict[str, str] = {}
    not_folded: dict[str, str] = {}
    for name, bn in modules.items():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            layer, reason = _fold_source(name, bn, flow, modules)
            if reason is None:
                pairs[name] = layer
            else:
                not_folded[name] = reason
    linear_pairs = [bn for bn, layer in pairs.items() if isinstance(modules[layer], nn.Linear)]
    if linear_pairs:
        ndims = _output_ndims(model, [pairs[bn] for bn in linear_pairs], _example(model, input_shape))
        for bn in linear_pairs:
            if ndims.get(pairs[bn]) != 2:
                not_folded[bn] = f"{pairs[bn]}'s output is not 2-D, so the BN's features are not its outputs"
                del pairs[bn]
    with torch.no_grad():
        for bn_name, layer_name in pairs.items():
            _fold_into(modules[layer_name], modules[bn_name])
            set_submodule(model, bn_name, nn.Identity())
    return {"folded": pairs, "not_folded": not_folded, **flow.details()}


def _example(model: nn.Module, input_shape: Sequence[int] | None) -> torch.Tensor:
    return example_input(model, input_shape or DEFAULT_INPUT_SHAPE)


def _fold_source(name: str, bn: nn.Module, flow: DataFlow, modules: dict[str, nn.Module]) -> tuple[str, str | None]:
    """The layer ``bn`` can fold into, or why it cannot."""
    from torch import nn

    if flow.calls[name] != 1:
        return "", "it never runs in a forward pass" if flow.calls[name] == 0 else f"it runs {flow.calls[name]} times per forward pass"
    if not bn.track_running_stats or bn.running_mean is None:
        return "", "it has no running statistics (track_running_stats=False), so it normalizes with batch statistics"
    producers = flow.producers[name]
    source = next(iter(producers)) if len(producers) == 1 else None
    layer = modules.get(source) if source else None
    foldable = isinstance(layer, nn.Linear) or (
        isinstance(layer, nn.modules.conv._ConvNd) and (not layer.transposed or layer.groups == 1))
    if not foldable:
        what = ", ".join(sorted(producers))
        return "", f"its input comes from {what}, not from a single convolution or linear layer"
    others = flow.users[source] - {name}
    if others or flow.calls[source] != 1:
        return "", f"{source}'s output also goes to {', '.join(sorted(others)) or 'another call'}"
    out_features = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
    if out_features != bn.num_features:
        return "", f"{source} has {out_features} outputs but the BN normalizes {bn.num_features} features"
    return source, None


def _fold_into(layer: nn.Module, bn: nn.Module) -> None:
    import torch
    from torch import nn

    dtype = layer.weight.dtype
    var = bn.running_var.double()
    scale = torch.rsqrt(var + bn.eps)
    if bn.affine:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale
    if bn.affine:
        shift = shift + bn.bias.double()
    weight = layer.weight.double()
    # A transposed conv's weight is (in, out, ...); every other layer's is (out, in, ...).
    out_dim = 1 if getattr(layer, "transposed", False) else 0
    shape = [1] * weight.dim()
    shape[out_dim] = -1
    layer.weight.copy_((weight * scale.reshape(shape)).to(dtype))
    bias = layer.bias.double() if layer.bias is not None else torch.zeros_like(scale)
    new_bias = (bias * scale + shift).to(dtype)
    if layer.bias is None:
        layer.bias = nn.Parameter(new_bias.to(layer.weight.device))
    else:
        layer.bias.copy_(new_bias)


def _output_ndims(model: nn.Module, names: list[str], example: torch.Tensor) -> dict[str, int]:
    import torch

    ndims: dict[str, int] = {}

    def record(name: str):
        def hook(module, args, output):
            ndims.setdefault(name, output.dim())
        return hook

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(record(n)) for n in names]
    try:
        with eval_mode(model), torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    return ndims
