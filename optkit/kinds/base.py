"""The model-kind contract: what a kind of model takes, returns and keeps (the registry is :mod:`optkit.kinds.registry`).

A **model kind** describes a family of models: what they take (an image batch,
token ids and an attention mask, a list of images), what of their output is
compared and exported, which sub-module structured pruning works on, and which
layers keep their width. Passes, metrics, export and reports ask the kind of a
model (:func:`kind_of`) instead of assuming an image tensor.

A model's kind is the one named for it (``set_kind``, ``--kind``) or else the
first registered kind, by ``priority``, whose :meth:`ModelKind.matches` accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from optkit.core.errors import OptkitError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["KIND_ATTRIBUTE", "ModelInputs", "ModelKind", "call_with", "export_view", "flatten_tensors",
           "model_device"]

#: The attribute a named kind is stored under on a model (it survives ``copy.deepcopy`` and in-place pruning).
KIND_ATTRIBUTE = "_optkit_kind"


@dataclass
class ModelInputs:
    """Example inputs for one forward call: ``model(*args, **kwargs)``.

    Attributes:
        args: positional arguments (tensors, or a list of tensors for detection).
        kwargs: keyword arguments (tensors, or plain flags such as ``use_cache=False``).
        names: ONNX input names of the tensors, in the order :meth:`tensors` gives them.
    """

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ("input",)

    def call(self, model: nn.Module) -> Any:
        """Run ``model`` on these inputs."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor, flattened in call order (what an exported graph takes)."""
        import torch

        values = [*self.args, *self.kwargs.values()]
        flat: list = []
        for value in values:
            flat.extend(value if isinstance(value, (list, tuple)) else [value])
        return [t for t in flat if isinstance(t, torch.Tensor)]

    def with_tensors(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> ModelInputs:
        """The same call with its tensors replaced, in :meth:`tensors` order (what an exported graph is given)."""
        import torch

        supply = iter(tensors)

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return next(supply)
            if isinstance(value, (list, tuple)):
                return type(value)(swap(v) for v in value)
            return value

        return ModelInputs(tuple(swap(v) for v in self.args), {k: swap(v) for k, v in self.kwargs.items()}, self.names)

    def first(self) -> Any:
        """The first argument alone (an image batch, token ids, a list of images): ``model(first)`` runs the model."""
        return self.args[0] if self.args else next(iter(self.kwargs.values()))

    def packed(self) -> Any:
        """The form torch-pruning's tracer and op counter unpack into this call: a tuple of arguments or a dict."""
        if self.kwargs and self.args:
            raise ValueError("inputs with both positional and keyword arguments have no packed form; call them")
        return dict(self.kwargs) if self.kwargs else tuple(self.args)

    @property
    def batch_size(self) -> int:
        """The number of samples: the first tensor's first dimension, or a list's length (detection)."""
        first = self.first()
        return len(first) if isinstance(first, (list, tuple)) else int(first.shape[0])


class ModelKind:
    """Base class of every model kind; subclasses override what differs from an image classifier.

    Class attributes:
        name: the unique registry name (``image_classifier``, ``tokens``...).
        description: one line for ``optkit kinds`` and error messages.
        priority: kinds are tried for inference from low to high; the generic image
            classifier comes last.
        shape_help: what an input shape means for this kind (for messages).
        dynamic_batch: whether an exported graph can take any batch size.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    priority: ClassVar[int] = 50
    shape_help: ClassVar[str] = "N,C,H,W"
    dynamic_batch: ClassVar[bool] = True

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is of this kind, judged from its structure (never from its class name alone)."""
        return False

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        """The example input shape used when none is given."""
        raise NotImplementedError

    def check_shape(self, model: nn.Module, shape: tuple[int, ...]) -> None:
        """Raise :class:`OptkitError` (one line, naming the option to change) for a shape this model cannot take."""

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        """Reproducible example inputs of ``shape`` on the model's device."""
        raise NotImplementedError

    def outputs(self, output: Any) -> list[torch.Tensor]:
        """The output tensors that are compared (export parity) and exported, in a fixed order."""
        return flatten_tensors(output)

    def output_names(self, count: int) -> list[str]:
        """ONNX output names for ``count`` output tensors."""
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]

    def compare(self, expected: list[Any], actual: list[Any]) -> tuple[float, float]:
        """Largest difference between two models' outputs (numpy arrays) and the scale it is judged against.

        Returns:
            ``(max |expected - actual|, max |expected|)``.

        Raises:
            ValueError: when the outputs' count or shapes differ.
        """
        import numpy as np

        if len(actual) != len(expected) or any(a.shape != e.shape for a, e in zip(actual, expected)):
            raise ValueError(f"output shapes {[a.shape for a in actual]} differ from {[e.shape for e in expected]}")
        diff = max((float(np.max(np.abs(a.astype(np.float64) - e))) for a, e in zip(actual, expected) if e.size),
                   default=0.0)
        scale = max((float(np.max(np.abs(e))) for e in expected if e.size), default=0.0)
        return diff, scale

    def export_module(self, model: nn.Module, inputs: ModelInputs) -> nn.Module:
        """The module handed to the ONNX exporter: the model itself, or a view taking :meth:`ModelInputs.tensors`
        and returning :meth:`outputs` when the model's call or output is not plain tensors."""
        return model

    def prune_root(self, model: nn.Module) -> str | None:
        """The sub-module structured pruning works on (its outputs keep their width), or ``None`` for the whole model."""
        return None

    def held_layers(self, model: nn.Module) -> dict[str, str]:
        """Modules (by qualified name) that keep their output width, with the reason, beyond the output layers."""
        return {}


def call_with(model: nn.Module, inputs: Any) -> Any:
    """Run ``model`` on example inputs: :class:`ModelInputs`, a list of positional arguments, or one tensor."""
    if isinstance(inputs, ModelInputs):
        return inputs.call(model)
    return model(*inputs) if isinstance(inputs, list) else model(inputs)


def export_view(model: nn.Module, inputs: ModelInputs, kind: ModelKind) -> nn.Module:
    """A module whose forward takes ``inputs``' tensors as flat arguments and returns the kind's output tensors."""
    from torch import nn

    class ExportView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return tuple(kind.outputs(inputs.with_tensors(tensors).call(self.model)))

    return ExportView().eval()


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for stateless models."""
    import torch

    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def flatten_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple, list or dict output, in order; other values are left out.

    Raises:
        OptkitError: when the output holds no tensor at all.
    """
    import torch

    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            stack[:0] = list(value.values())
        elif isinstance(value, (list, tuple)):
            stack[:0] = list(value)
    if not found:
        raise OptkitError(f"the model returns {type(output).__name__} with no tensor in it; "
                          "optkit compares and exports tensors (or tuples/lists/dicts of them)")
    return found
