"""Per-layer view of a model: channels, parameters, MACs and sparsity, layer by layer.

The rows partition the model exactly: every parameter belongs to one row and
every MAC counted by :func:`optkit.model.stats.count_macs` is charged to one row,
so the column totals equal the figures in ``report.json``. A row is a layer
torch-pruning's op counter knows (conv, linear, norm, activation, pooling,
attention...) or a module that holds parameters directly (e.g. a ViT's class
token); modules that merely group other modules get no row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

#: ``(model, input_shape) -> {layer name: reason}``: the layers a structured prune leaves untouched.
DryRun = Callable[["nn.Module", tuple[int, ...]], dict[str, str]]


@dataclass
class LayerInfo:
    """One row of the per-layer table.

    Attributes:
        name: the module's qualified name (``""`` for the model itself).
        type: the module's class name.
        in_channels: input channels/features, or ``None`` when the layer has none.
        out_channels: output channels/features, or ``None``.
        params: parameter elements charged to this row.
        macs: multiply-accumulates of this row at the inspected input shape.
        sparsity: fraction of exactly-zero weight elements (conv/linear only), else ``None``.
    """

    name: str
    type: str
    in_channels: int | None
    out_channels: int | None
    params: int
    macs: int
    sparsity: float | None

    @property
    def listed(self) -> bool:
        """Whether the printed table shows this row by default (it has parameters or channels)."""
        return bool(self.params) or self.out_channels is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Inspection:
    """The per-layer table of a model, its totals, and what a structured prune leaves alone.

    Attributes:
        input_shape: the input shape MACs were counted at.
        layers: one :class:`LayerInfo` per row.
        params: total parameters (equals :func:`optkit.model.stats.count_params`).
        macs: total MACs (equals :func:`optkit.model.stats.count_macs`).
        sparsity: conv/linear weight sparsity (equals :func:`optkit.model.stats.weight_sparsity`).
        skipped_layers: layer name -> why a structured prune leaves it untouched.
        prune_error: why a structured prune could not trace the model, if it could not.
    """

    input_shape: tuple[int, ...]
    layers: list[LayerInfo]
    params: int
    macs: int
    sparsity: float
    skipped_layers: dict[str, str] = field(default_factory=dict)
    prune_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "input_shape": list(self.input_shape),
            "totals": {"params": self.params, "macs": self.macs, "sparsity": self.sparsity},
            "layers": [layer.to_dict() for layer in self.layers],
            "skipped_layers": dict(self.skipped_layers),
        }
        if self.prune_error is not None:
            out["prune_error"] = self.prune_error
        return out


def inspect_model(model: nn.Module, input_shape: Sequence[int], *, prune_dry_run: DryRun | None = None) -> Inspection:
    """Build the per-layer table of ``model`` at ``input_shape``.

    Args:
        model: the model (left unchanged; its train/eval mode is restored).
        input_shape: example input shape, e.g. ``(1, 3, 224, 224)``.
        prune_dry_run: what a structured prune would leave untouched, traced on the model
            (``optkit inspect`` passes :func:`optkit.passes.prune.passes.skipped_layers`); without
            it, :func:`skipped_layers` names what a structured prune always leaves whole.

    Returns:
        the rows, their totals and the layers a structured prune would skip.

    Raises:
        OptkitError: if the model does not run at ``input_shape``.
    """
    from optkit.model.stats import weight_sparsity

    shape = tuple(int(v) for v in input_shape)
    layer_macs, total_macs = _layer_macs(model, shape)
    layers = _rows(model, layer_macs)
    skipped, prune_error = {}, None
    try:
        skipped = dict((prune_dry_run or skipped_layers)(model, shape))
    except Exception as e:  # the dry run traces with torch-pruning, which some graphs defeat: report it
        prune_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}"
    return Inspection(
        input_shape=shape,
        layers=layers,
        params=sum(layer.params for layer in layers),
        macs=total_macs,
        sparsity=weight_sparsity(model),
        skipped_layers=skipped,
        prune_error=prune_error,
    )


def layer_channels(model: nn.Module) -> dict[str, int]:
    """Output channels (or features) of every conv and linear layer, by name, in module order."""
    from optkit.model.stats import prunable_weights

    return {name: _channels(module)[1] for name, module in prunable_weights(model)}


def skipped_layers(model: nn.Module, input_shape: Sequence[int]) -> dict[str, str]:
    """Layers a structured prune always leaves whole, found without tracing: the final classifier and attention blocks.

    A dry run of the prune (:func:`optkit.passes.prune.passes.skipped_layers`) finds every layer it would skip.
    """
    import torch

    reasons = {name: "final classifier: its outputs are the model's outputs"
               for name in _last_layer(model, input_shape)}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            reasons[name] = "attention block: its heads are left whole"
    return reasons


def _last_layer(model: nn.Module, input_shape: Sequence[int]) -> list[str]:
    """The name of the last conv/linear layer a forward pass runs (the classifier), as a list."""
    import torch

    from optkit.model.inputs import example_input
    from optkit.model.state import eval_mode
    from optkit.model.stats import PRUNABLE_WEIGHT_TYPES

    executed: list[str] = []
    hooks = [module.register_forward_hook(lambda m, i, o, name=name: executed.append(name))
             for name, module in model.named_modules() if isinstance(module, PRUNABLE_WEIGHT_TYPES)]
    try:
        with eval_mode(model), torch.no_grad():
            model(example_input(model, input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    return executed[-1:]


def _layer_macs(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[dict[int, int], int]:
    """MACs per sample, per module (keyed by ``id``) and in total, from torch-pruning's op counter.

    Counted at batch size 1, like :func:`optkit.model.stats.count_macs`.
    """
    import torch
    import torch_pruning as tp

    from optkit.core.errors import OptkitError
    from optkit.model.inputs import example_input
    from optkit.model.state import eval_mode

    inputs = example_input(model, (1, *input_shape[1:]))
    try:
        with eval_mode(model), torch.no_grad():
            total, _, per_module, _ = tp.utils.count_ops_and_params(model, inputs, layer_wise=True)
    except Exception as e:
        shape = ",".join(map(str, input_shape))
        raise OptkitError(f"the model does not run on input shape {shape} ({e}); set --input-shape to what it expects") from e
    return {id(m): int(v or 0) for m, v in per_module.items()}, int(total)


def _rows(model: nn.Module, layer_macs: dict[int, int]) -> list[LayerInfo]:
    from torch_pruning.utils.op_counter import is_supported_instance

    rows: list[LayerInfo] = []
    seen_modules: set[int] = set()
    seen_params: set[int] = set()

    def own_params(module: nn.Module, recurse: bool) -> int:
        count = 0
        for p in module.parameters(recurse=recurse):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                count += p.numel()
        return count

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        counted = is_supported_instance(module)
        # The op counter charges a known layer's MACs to it and does not look inside.
        params = own_params(module, recurse=counted)
        if counted or params:
            in_ch, out_ch = _channels(module)
            rows.append(LayerInfo(name, type(module).__name__, in_ch, out_ch, params,
                                  layer_macs.get(id(module), 0) if counted else 0, _sparsity(module)))
        if not counted:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return rows


def _channels(module: nn.Module) -> tuple[int | None, int | None]:
    from torch import nn

    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return module.in_channels, module.out_channels
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return module.num_features, module.num_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels, module.num_channels
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim, module.embed_dim
    return None, None


def _sparsity(module: nn.Module) -> float | None:
    from optkit.model.stats import PRUNABLE_WEIGHT_TYPES

    if not isinstance(module, PRUNABLE_WEIGHT_TYPES):
        return None
    weight = module.weight.detach()
    return float((weight == 0).sum()) / weight.numel() if weight.numel() else 0.0


def format_table(inspection: Inspection, *, all_layers: bool = False) -> list[tuple[str, ...]]:
    """The table rows as strings, ready for printing.

    Args:
        inspection: what :func:`inspect_model` returned.
        all_layers: include rows with neither parameters nor channels
            (activations, pooling); by default they are left out of the
            printed table (their MACs still count in the totals).

    Returns:
        ``(name, type, in, out, params, MACs, sparsity)`` string tuples.
    """
    def number(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    rows = []
    for layer in inspection.layers:
        if not all_layers and not layer.listed:
            continue
        sparsity = "-" if layer.sparsity is None else f"{layer.sparsity:.1%}"
        rows.append((layer.name or "(model)", layer.type, number(layer.in_channels), number(layer.out_channels),
                     number(layer.params), number(layer.macs), sparsity))
    return rows
