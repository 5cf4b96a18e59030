"""The pass contract: a frozen dataclass of settings that transforms a model.

A pass is usable on its own::

    model = StructuredPrune(ratio=0.3)(model)

Subclasses set ``name`` (the unique registry name), validate their settings in
``__post_init__`` (raising ``ValueError`` that states the valid range), and
implement :meth:`Pass.apply`. Passes may change the model in place; the class
attribute ``in_place`` says whether they do, so callers that need the original
(distillation, ratio searches) know to keep a deep copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import nn

#: Settings a pipeline fills in for every pass that has them and leaves them unset.
SHARED_SETTINGS = ("input_shape", "device")

DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)

#: Field metadata for settings that are run options or live objects (a teacher
#: model, ``resume``), left out of :meth:`Pass.settings` and so out of recipes.
NOT_IN_RECIPE = {"recipe": False}


@dataclass
class PassResult:
    """What a pass returns from :meth:`Pass.apply`.

    Attributes:
        model: the transformed model (possibly the same object, changed in place).
        details: JSON-serialisable facts for the report, e.g. skipped layers.
    """

    model: Any
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """Base class of every optkit pass."""

    name: ClassVar[str] = ""
    in_place: ClassVar[bool] = True

    def apply(self, model: nn.Module) -> PassResult:
        """Transform ``model`` and return it with details for the report."""
        raise NotImplementedError

    def __call__(self, model: nn.Module) -> nn.Module:
        return self.apply(model).model

    def settings(self) -> dict[str, Any]:
        """The pass's recipe settings as plain values (tuples become lists; unset ones and run options are left out)."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.metadata.get("recipe") is False:
                continue
            values[f.name] = _plain(value)
        return values

    def _normalize(self, field_name: str, value: Any) -> None:
        """Set a field on this frozen instance during ``__post_init__`` validation."""
        object.__setattr__(self, field_name, value)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def check_range(name: str, value: Any, low: float, high: float, *, high_inclusive: bool = False) -> float:
    """Validate a number in ``[low, high)`` (or ``[low, high]``) and return it as a float.

    Raises:
        ValueError: naming the setting and the valid range.
    """
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    number = float(value) if ok_type else float("nan")
    inside = low <= number <= high if high_inclusive else low <= number < high
    if not inside:
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be a number in [{low}, {high}{bracket}, got {value!r}")
    return number


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Validate that ``value`` is one of ``choices``.

    Raises:
        ValueError: naming the setting and the valid choices.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_input_shape(value: Any) -> tuple[int, ...] | None:
    """Validate an input shape such as ``(1, 3, 224, 224)``; ``None`` means "filled in later".

    Raises:
        ValueError: if it is not a sequence of positive integers of length 2 to 5.
    """
    if value is None:
        return None
    try:
        shape = tuple(int(v) for v in value)
        valid = 2 <= len(shape) <= 5 and all(v > 0 for v in shape) and all(
            float(v) == int(v) for v in value
        )
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"input_shape must be 2 to 5 positive integers like (1, 3, 224, 224); got {value!r}")
    return shape
