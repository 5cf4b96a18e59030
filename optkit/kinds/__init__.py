"""Model kinds: what a family of models takes, returns, keeps and is compared on (see :mod:`optkit.kinds.base`).

Built in: ``detection``, ``segmentation``, ``tokens`` (language models) and
``image_classifier`` (the fallback). ``kind_of(model)`` gives a model's kind;
:mod:`optkit.kinds.registry` says how kinds are found.
"""

from optkit.kinds.base import ModelInputs, ModelKind, call_with, flatten_tensors, model_device
from optkit.kinds.registry import ENTRY_POINT_GROUP, get_kind, kind_of, list_kinds, register_kind, set_kind

__all__ = ["ENTRY_POINT_GROUP", "ModelInputs", "ModelKind", "call_with", "example_inputs", "flatten_tensors", "get_kind",
           "kind_of", "list_kinds", "model_device", "register_kind", "set_kind"]


def example_inputs(model, shape, *, seed: int = 0) -> ModelInputs:
    """The example inputs of ``model``'s kind at ``shape`` (see :meth:`ModelKind.example_inputs`)."""
    return kind_of(model).example_inputs(model, tuple(int(v) for v in shape), seed=seed)
