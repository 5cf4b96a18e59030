"""Model kinds: what a family of models takes, returns, keeps and is compared on (see :mod:`optkit.kinds.base`).

Each kind is one module of this package whose :class:`ModelKind` subclass is
decorated with ``@register_kind``; ``builtin_kinds()`` names optkit's own and
``list_kinds()`` every registered one (plugins' too). ``kind_of(model)`` gives a
model's kind; :mod:`optkit.kinds.registry` says how kinds are found.
"""

from optkit.kinds.base import (ModelInputs, ModelKind, Throughput, call_with, flatten_tensors, is_hf_pretrained,
                               model_device)
from optkit.kinds.registry import (ENTRY_POINT_GROUP, builtin_kinds, get_kind, kind_of, list_kinds, register_kind,
                                   set_kind)

__all__ = ["ENTRY_POINT_GROUP", "ModelInputs", "ModelKind", "Throughput", "builtin_kinds", "call_with", "example_inputs",
           "flatten_tensors", "get_kind", "is_hf_pretrained", "kind_of", "list_kinds", "model_device", "register_kind",
           "set_kind"]


def example_inputs(model, shape, *, seed: int = 0) -> ModelInputs:
    """The example inputs of ``model``'s kind at ``shape`` (see :meth:`ModelKind.example_inputs`)."""
    return kind_of(model).example_inputs(model, tuple(int(v) for v in shape), seed=seed)
