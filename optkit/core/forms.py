"""Model forms: a pipeline holds a PyTorch model until an export step turns it into a file form.

Each pass says which form it takes (``accepts``) and which it returns
(``produces``); a :class:`~optkit.core.pipeline.Pipeline` checks that every
step takes what the step before it made. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

TORCH = "torch"
ONNX = "onnx"
#: Each form in words, and the step that makes it, for error messages.
FORMS = {TORCH: ("a PyTorch model", None), ONNX: ("an ONNX model", "export_onnx (--export onnx)")}


@dataclass(frozen=True)
class OnnxModel:
    """A model as a verified ONNX file.

    Attributes:
        path: the ONNX file.
        input_shape: the example input shape it was exported and checked at.
        source: the PyTorch model it was exported from (what ``model.pt`` saves).
        precision: ``fp32``, ``fp16`` (weights stored in half precision) or ``int8``.
    """

    path: Path
    input_shape: tuple[int, ...]
    source: Any
    precision: str = "fp32"


def form_of(model: Any) -> str:
    """The form of a model a pipeline holds: :data:`ONNX` for an :class:`OnnxModel`, else :data:`TORCH`."""
    return ONNX if isinstance(model, OnnxModel) else TORCH


def torch_model(model: Any) -> Any:
    """The PyTorch model behind any form (the model itself, or the one a file form was exported from)."""
    return model.source if isinstance(model, OnnxModel) else model


def describe(form: str) -> str:
    """A form in words (``a PyTorch model``); an unknown form by its name."""
    return FORMS.get(form, (f"a {form} model", None))[0]


def made_by(form: str) -> str | None:
    """The step that turns a PyTorch model into ``form``, for messages (``None`` when unknown)."""
    return FORMS.get(form, (None, None))[1]
