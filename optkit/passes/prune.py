"""Pruning passes: L1 unstructured (zeroes weights) and structured (removes channels).

Unstructured pruning shrinks nothing on dense kernels: the zeros cost the same
time. Structured pruning physically removes channels with torch-pruning's
dependency graph, so the model gets smaller and faster. Architectures that
torch-pruning does not follow on its own (window attention, ViT heads,
channel shuffle) get help from :mod:`optkit.passes._prune_arch`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.passes.base import (
    DEFAULT_INPUT_SHAPE,
    Pass,
    PassResult,
    check_choice,
    check_input_shape,
    check_range,
)

if TYPE_CHECKING:
    from torch import nn

STRUCTURED_IMPORTANCE = ("l1", "l2", "taylor", "bn_scale", "random")
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class L1Unstructured(Pass):
    """Zero the smallest-magnitude conv/linear weights (L1), made permanent.

    Args:
        ratio: fraction of weights to zero, in [0, 1).
        global_: rank all conv/linear weights together instead of per layer.

    The pruning reparametrization (``weight_orig``, ``weight_mask``, forward
    pre-hooks) is removed afterwards, so the model is an ordinary module.
    The report's ``sparsity`` is measured exactly after pruning. Works in place.
    """

    name = "l1_unstructured"
    ratio: float = 0.3
    global_: bool = False

    def __post_init__(self):
        self._normalize("ratio", check_range("ratio", self.ratio, 0.0, 1.0))
        if not isinstance(self.global_, bool):
            raise ValueError(f"global_ must be true or false, got {self.global_!r}")

    def apply(self, model: nn.Module) -> PassResult:
        from torch.nn.utils import prune

        from optkit.metrics import prunable_weights, weight_sparsity

        targets = [(module, "weight") for _, module in prunable_weights(model)]
        if not targets:
            return PassResult(model, {"pruned_layers": 0, "sparsity": 0.0})
        if self.global_:
            prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=self.ratio)
        else:
            for module, param in targets:
                prune.l1_unstructured(module, param, amount=self.ratio)
        for module, param in targets:
            prune.remove(module, param)
        return PassResult(model, {"pruned_layers": len(targets), "sparsity": weight_sparsity(model)})


@dataclass(frozen=True)
class StructuredPrune(Pass):
    """Remove whole channels with torch-pruning's dependency graph (group L1 by default).

    Args:
        ratio: fraction of channels to remove from each prunable group, in [0, 1).
            Ignored when ``target_macs`` or ``target_params`` is set.
        round_to: keep channel counts multiples of this (aligned counts run
            faster); 1 disables rounding.
        importance: channel ranking: ``l1``, ``l2``, ``taylor`` (gradient x
            weight; needs ``data`` or ``calibration``), ``bn_scale`` or
            ``random`` (a baseline).
        global_: rank channels across all layers instead of per layer.
        iterative_steps: reach ``ratio`` in this many equal steps.
        ignored_layers: fnmatch patterns of module names whose output channels
            are kept (a matched container keeps all its layers); their input
            channels still follow the layers that feed them. Layers whose
            outputs are the model's outputs (the classifier) always keep theirs.
        layer_ratios: per-layer ratio overrides, keyed by fnmatch pattern.
        target_macs: prune until MACs are this fraction of the original, in
            (0, 1); the ratio is found by bisection on copies of the model.
        target_params: the same for the parameter count.
        target_tolerance: stop the search once the achieved fraction is this close.
        timeout_s: time limit for tracing and pruning one model (torch-pruning
            can loop forever on unsupported graphs); the pass then fails with
            a clear error instead of hanging. Needs the main thread (SIGALRM);
            elsewhere it is not enforced and the report says so.
        submodule: prune only this sub-module (e.g. ``backbone``), keeping the
            widths of its outputs. Detection and segmentation models default to
            their ``backbone``.
        data: dataset spec (see :mod:`optkit.data`) whose first batches feed
            ``taylor`` importance.
        calibration_batches: how many batches ``taylor`` uses.
        batch_size: batch size when reading ``data``.
        calibration: Python only (not written to recipes): an iterable of
            ``(inputs, targets)`` batches for ``taylor``, used instead of ``data``.
        input_shape: example input shape used to trace the model.

    Works in place, except with a target, where the returned model is the
    pruned copy that met it. The model is put in eval mode while it is traced
    and restored after.
    """

    name = "structured_prune"
    ratio: float = 0.3
    round_to: int = 8
    importance: str = "l1"
    global_: bool = False
    iterative_steps: int = 1
    ignored_layers: tuple[str, ...] = ()
    layer_ratios: dict[str, float] | None = None
    target_macs: float | None = None
    target_params: float | None = None
    target_tolerance: float = 0.01
    timeout_s: float = DEFAULT_TIMEOUT_S
    submodule: str | None = None
    data: str | None = None
    calibration_batches: int = 4
    batch_size: int = 16
    calibration: Any = field(default=None, compare=False, repr=False)
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        self._normalize("ratio", check_range("ratio", self.ratio, 0.0, 1.0))
        for name in ("round_to", "iterative_steps", "calibration_batches", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_choice("importance", self.importance, STRUCTURED_IMPORTANCE)
        if not isinstance(self.global_, bool):
            raise ValueError(f"global_ must be true or false, got {self.global_!r}")
        if isinstance(self.ignored_layers, str) or not all(isinstance(p, str) for p in self.ignored_layers):
            raise ValueError("ignored_layers must be a list of module-name patterns, e.g. ['features.0', 'layer4.*']")
        self._normalize("ignored_layers", tuple(self.ignored_layers))
        if self.layer_ratios is not None:
            if not isinstance(self.layer_ratios, dict):
                raise ValueError("layer_ratios must map module-name patterns to ratios, e.g. {'layer4.*' = 0.5}")
            self._normalize("layer_ratios", {str(k): check_range(f"layer_ratios[{k!r}]", v, 0.0, 1.0)
                                             for k, v in self.layer_ratios.items()})
        for name in ("target_macs", "target_params"):
            value = getattr(self, name)
            if value is not None:
                checked = check_range(name, value, 0.0, 1.0)
                if checked == 0.0:
                    raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
                self._normalize(name, checked)
        if self.target_macs is not None and self.target_params is not None:
            raise ValueError("give target_macs or target_params, not both")
        self._normalize("target_tolerance", check_range("target_tolerance", self.target_tolerance, 0.0, 0.5))
        self._normalize("timeout_s", check_range("timeout_s", self.timeout_s, 0.0, float("inf")))
        if self.submodule is not None and not isinstance(self.submodule, str):
            raise ValueError(f"submodule must be a module name such as 'backbone', got {self.submodule!r}")
        if self.data is not None and not isinstance(self.data, str):
            raise ValueError(f"data must be a dataset spec such as 'fashion-mnist', got {self.data!r}")
        if self.importance == "taylor" and self.data is None and self.calibration is None:
            raise ValueError("importance 'taylor' needs data: set data (a dataset spec) or calibration (batches)")
        self._normalize("input_shape", check_input_shape(self.input_shape))

    def settings(self) -> dict[str, Any]:
        """Recipe settings; the Python-only ``calibration`` batches are left out."""
        values = super().settings()
        values.pop("calibration", None)
        return values

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.passes import _prune_target

        if self.target_macs is None and self.target_params is None:
            return PassResult(model, self.prune(model, self.ratio))
        return _prune_target.search(self, model)

    def prune(self, model: nn.Module, ratio: float) -> dict[str, Any]:
        """Prune ``model`` in place at ``ratio`` with this pass's other settings.

        Returns:
            details for the report: ``skipped_layers`` (name -> reason),
            ``pruned_layers`` (count) and the settings that shaped the run.

        Raises:
            OptkitError: when tracing or pruning exceeds ``timeout_s``.
            ValueError: for a layer pattern or sub-module that matches nothing.
        """
        from optkit.errors import OptkitError
        from optkit.passes import _prune_limits, _prune_structured

        root, inputs, submodule = self._root_and_inputs(model)
        held, overrides = _prune_structured.user_choices(root, self.ignored_layers, self.layer_ratios)
        options = _prune_structured.Options(_importance(self.importance), ratio, self.global_,
                                            self.iterative_steps, self.round_to)
        before_step = self._taylor_gradients(model) if self.importance == "taylor" else None
        try:
            with _prune_limits.time_limit(self.timeout_s) as enforced:
                skipped = _prune_structured.prune_tree(root, inputs, options, held, overrides,
                                                       submodule=submodule, before_step=before_step)
        except _prune_limits.TimeLimitExceeded as e:
            raise OptkitError(
                f"structured pruning of {type(root).__name__} {e} (torch-pruning may be looping on this graph); "
                "the model may be partly changed, so start again from the original, and raise timeout_s or "
                "add the blocks it stalls on to ignored_layers") from e
        details: dict[str, Any] = {
            "ratio": ratio,
            "pruned_layers": sum(1 for name in _conv_linear_names(root) if name not in skipped),
            "skipped_layers": skipped,
        }
        if submodule:
            details["submodule"] = submodule
        if not enforced and self.timeout_s:
            details["time_limit"] = "not enforced (SIGALRM needs the main thread)"
        return details

    def _root_and_inputs(self, model: nn.Module) -> tuple[nn.Module, Any, str | None]:
        import torch

        from optkit.metrics import eval_mode, example_input

        inputs = example_input(model, self.input_shape or DEFAULT_INPUT_SHAPE)
        submodule = self.submodule if self.submodule is not None else default_submodule(model)
        if not submodule:
            return model, inputs, None
        try:
            root = model.get_submodule(submodule)
        except AttributeError as e:
            raise ValueError(f"submodule {submodule!r} is not a module of {type(model).__name__}") from e
        captured: list = []
        hook = root.register_forward_pre_hook(lambda module, args: captured.append(args))
        try:
            with eval_mode(model), torch.no_grad():
                model(inputs)
        finally:
            hook.remove()
        if not captured:
            raise ValueError(f"submodule {submodule!r} does not run in a forward pass at input_shape {self.input_shape}")
        args = captured[0]
        return root, args[0] if len(args) == 1 else list(args), submodule

    def _taylor_gradients(self, model: nn.Module):
        batches = self.calibration if self.calibration is not None else _data_batches(self)

        def accumulate() -> None:
            import torch
            import torch.nn.functional as F

            from optkit.metrics import model_device

            device = model_device(model)
            model.zero_grad(set_to_none=True)
            seen = 0
            with torch.enable_grad():
                for batch in batches:
                    if seen >= self.calibration_batches:
                        break
                    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                        raise ValueError("taylor importance needs (inputs, targets) batches")
                    inputs, targets = batch[0].to(device), batch[1].to(device)
                    F.cross_entropy(model(inputs), targets).backward()
                    seen += 1
            if not seen:
                raise ValueError("taylor importance got no calibration batches")

        return accumulate


def default_submodule(model: nn.Module) -> str | None:
    """``backbone`` for torchvision detection and segmentation models, else ``None``."""
    kind = type(model).__module__
    detection = kind.startswith(("torchvision.models.detection", "torchvision.models.segmentation"))
    return "backbone" if detection and hasattr(model, "backbone") else None


def skipped_layers(model: nn.Module, input_shape: Iterable[int] = DEFAULT_INPUT_SHAPE, *,
                   ignored_layers: Iterable[str] = (), round_to: int = 8) -> dict[str, str]:
    """Conv/linear layers a structured prune would leave untouched, with the reason for each.

    A dry run: the model is traced but not changed (its train/eval mode is restored).

    Args:
        model: the model.
        input_shape: example input shape used to trace it.
        ignored_layers: fnmatch patterns the prune would be given.
        round_to: the channel rounding the prune would use.

    Returns:
        ``{layer name: reason}``; layer names are relative to the pruned
        sub-module (``backbone`` for detection/segmentation models).
    """
    from optkit.passes import _prune_structured

    settings = StructuredPrune(input_shape=tuple(input_shape), ignored_layers=tuple(ignored_layers), round_to=round_to)
    root, inputs, submodule = settings._root_and_inputs(model)
    held, _ = _prune_structured.user_choices(root, settings.ignored_layers, None)
    options = _prune_structured.Options(_importance("l1"), settings.ratio, False, 1, round_to)
    return _prune_structured.prune_tree(root, inputs, options, held, {}, submodule=submodule, dry_run=True)


def _conv_linear_names(root: nn.Module) -> list[str]:
    from optkit.metrics import prunable_weights

    return [name for name, _ in prunable_weights(root)]


def _data_batches(settings: StructuredPrune):
    from optkit.data import load_dataset, make_loader

    dataset = load_dataset(settings.data, "train", augment=False)
    return make_loader(dataset, settings.batch_size, shuffle=True, num_workers=0, seed=0)


def _importance(kind: str):
    import torch_pruning as tp

    if kind == "l1":
        return tp.importance.GroupMagnitudeImportance(p=1)
    if kind == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if kind == "taylor":
        return tp.importance.GroupTaylorImportance()
    if kind == "bn_scale":
        return tp.importance.BNScaleImportance()
    return tp.importance.RandomImportance()
