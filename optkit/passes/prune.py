"""Pruning passes: L1 unstructured (zeroes weights) and structured (removes channels).

Unstructured pruning shrinks nothing on dense kernels: the zeros cost the same
time. Structured pruning physically removes channels with torch-pruning's
dependency graph, so the model gets smaller and faster.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
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

STRUCTURED_IMPORTANCE = ("l1", "l2", "bn_scale", "random")


@dataclass(frozen=True)
class L1Unstructured(Pass):
    """Zero the smallest-magnitude conv/linear weights (L1), made permanent.

    Args:
        ratio: fraction of weights to zero, in [0, 1).
        global_: rank all conv/linear weights together instead of per layer.

    The pruning reparametrization (``weight_orig``, ``weight_mask``, forward
    pre-hooks) is removed afterwards, so the model is an ordinary module.
    Works in place.
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

        from optkit.metrics import prunable_weights

        targets = [(module, "weight") for _, module in prunable_weights(model)]
        if not targets:
            return PassResult(model, {"pruned_layers": 0})
        if self.global_:
            prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=self.ratio)
        else:
            for module, param in targets:
                prune.l1_unstructured(module, param, amount=self.ratio)
        for module, param in targets:
            prune.remove(module, param)
        return PassResult(model, {"pruned_layers": len(targets)})


@dataclass(frozen=True)
class StructuredPrune(Pass):
    """Remove whole channels with torch-pruning's dependency graph (group L1 by default).

    Args:
        ratio: fraction of channels to remove from each prunable group, in [0, 1).
        round_to: keep channel counts multiples of this (aligned counts run
            faster); 1 disables rounding.
        importance: channel ranking: ``l1``, ``l2``, ``bn_scale`` or ``random``.
        global_: rank channels across all layers instead of per layer.
        iterative_steps: reach ``ratio`` in this many equal steps.
        ignored_layers: fnmatch patterns of module names to leave untouched;
            the final classifier is always left untouched.
        layer_ratios: per-module ratio overrides, keyed by fnmatch pattern.
        input_shape: example input shape used to trace the model.

    Works in place; the model is put in eval mode while it is traced.
    """

    name = "structured_prune"
    ratio: float = 0.3
    round_to: int = 8
    importance: str = "l1"
    global_: bool = False
    iterative_steps: int = 1
    ignored_layers: tuple[str, ...] = ()
    layer_ratios: dict[str, float] | None = None
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        self._normalize("ratio", check_range("ratio", self.ratio, 0.0, 1.0))
        if not isinstance(self.round_to, int) or isinstance(self.round_to, bool) or self.round_to < 1:
            raise ValueError(f"round_to must be a positive integer (1 disables rounding), got {self.round_to!r}")
        check_choice("importance", self.importance, STRUCTURED_IMPORTANCE)
        if not isinstance(self.global_, bool):
            raise ValueError(f"global_ must be true or false, got {self.global_!r}")
        if not isinstance(self.iterative_steps, int) or self.iterative_steps < 1:
            raise ValueError(f"iterative_steps must be a positive integer, got {self.iterative_steps!r}")
        if isinstance(self.ignored_layers, str) or not all(isinstance(p, str) for p in self.ignored_layers):
            raise ValueError("ignored_layers must be a list of module-name patterns, e.g. ['features.0', 'layer4.*']")
        self._normalize("ignored_layers", tuple(self.ignored_layers))
        for pattern, value in (self.layer_ratios or {}).items():
            check_range(f"layer_ratios[{pattern!r}]", value, 0.0, 1.0)
        self._normalize("input_shape", check_input_shape(self.input_shape))

    def apply(self, model: nn.Module) -> PassResult:
        import torch
        import torch_pruning as tp

        from optkit.metrics import PRUNABLE_WEIGHT_TYPES, example_input

        shape = self.input_shape or DEFAULT_INPUT_SHAPE
        inputs = example_input(model, shape)
        classifier = final_layer_names(model, inputs)
        ignored_names = sorted(set(classifier) | set(_matching(model, self.ignored_layers)))
        modules = dict(model.named_modules())
        ignored = [modules[n] for n in ignored_names]
        ignored += [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
        ratio_overrides = {
            modules[name]: value
            for pattern, value in (self.layer_ratios or {}).items()
            for name in _matching(model, (pattern,))
            if isinstance(modules[name], PRUNABLE_WEIGHT_TYPES)
        }
        pruner = tp.pruner.BasePruner(
            model,
            inputs,
            importance=_importance(self.importance),
            global_pruning=self.global_,
            pruning_ratio=self.ratio,
            pruning_ratio_dict=ratio_overrides or None,
            iterative_steps=self.iterative_steps,
            ignored_layers=ignored,
            round_to=self.round_to if self.round_to > 1 else None,
        )
        with torch.no_grad():
            for _ in range(self.iterative_steps):
                pruner.step()
        return PassResult(model, {"ignored_layers": ignored_names})


def final_layer_names(model: nn.Module, inputs: Any) -> list[str]:
    """Names of the last conv/linear layers to run in a forward pass (the classifier).

    Found from execution order, so it works whatever the classifier is called
    (``fc``, ``classifier.1``, ``heads.head``, a 1×1 conv in squeezenet).
    """
    import torch
    from torch import nn

    executed: list[str] = []
    hooks = [
        module.register_forward_hook(lambda m, i, o, name=name: executed.append(name))
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    ]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(inputs)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return executed[-1:]


def _matching(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    names = [name for name, _ in model.named_modules() if name]
    matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"layer pattern(s) {', '.join(map(repr, unmatched))} match no module of the model")
    return matched


def _importance(kind: str):
    import torch_pruning as tp

    if kind == "l1":
        return tp.importance.GroupMagnitudeImportance(p=1)
    if kind == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if kind == "bn_scale":
        return tp.importance.BNScaleImportance()
    return tp.importance.RandomImportance()
