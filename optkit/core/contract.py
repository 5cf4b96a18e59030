"""The pass contract: a frozen dataclass of declared settings that transforms a model.

A pass is usable on its own::

    model = StructuredPrune(ratio=0.3)(model)

Subclasses set ``name`` (the unique registry name), declare each setting once
with :func:`optkit.core.settings.setting` (validated by ``__post_init__``),
put rules that involve several settings in :meth:`Pass.check`, and implement
:meth:`Pass.apply`. Passes may change the model in place; the class attribute
``in_place`` says whether they do, so callers that need the original
(distillation, ratio searches) know to keep a deep copy.

``accepts`` and ``produces`` name the model forms a pass takes and returns
(:mod:`optkit.core.forms`): most passes work on a PyTorch model; an export pass
turns it into an ONNX file, and later passes (INT8) work on that. What a pass
needs from the run (output folder, teacher, resume, rank, data) comes from a
:class:`~optkit.core.context.RunContext` through :meth:`Pass.bind`.

Any callable ``model -> model`` also runs in a :class:`~optkit.core.pipeline.Pipeline`;
a ``Pass`` is the kind that also has a recipe and CLI form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from optkit.core.forms import TORCH
from optkit.core.settings import SHARED_SETTINGS, Settings, check_input_shape, declared

if TYPE_CHECKING:
    from torch import nn

    from optkit.core.context import RunContext

__all__ = ["DEFAULT_INPUT_SHAPE", "SHARED_SETTINGS", "Stage", "Pass", "PassResult", "check_input_shape"]

DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)


class Stage:
    """Where a pass runs in a pipeline built from CLI flags (lower first); recipes keep their own order."""

    DEVICE = 10
    PREPARE = 20
    PRUNE = 30
    TRANSFORM = 35
    RECALIBRATE = 40
    TRAIN = 50
    FOLD = 60
    LAYOUT = 70
    WRAP = 80
    EXPORT = 90
    QUANTIZE = 95


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
class Pass(Settings):
    """Base class of every optkit pass: its settings (validated on creation, see :class:`Settings`) and the transform.

    Class attributes:
        name: the unique registry name (snake_case).
        in_place: whether :meth:`apply` changes the model it is given.
        stage: the position in a pipeline built from CLI flags (see :class:`Stage`).
        flag: a CLI switch that adds the pass with its defaults (``"fold-bn"`` gives ``--fold-bn``).
        variant: ``(option, value)`` when passes share their enabling flags and
            an option picks one (``("method", "structured")``); the
            variant with ``variant_default = True`` is the option's default.
        accepts: the model form :meth:`apply` takes (:data:`optkit.core.forms.TORCH` or ``ONNX``).
        produces: the model form :meth:`apply` returns.
    """

    name: ClassVar[str] = ""
    in_place: ClassVar[bool] = True
    stage: ClassVar[int] = Stage.TRANSFORM
    flag: ClassVar[str | None] = None
    variant: ClassVar[tuple[str, str] | None] = None
    variant_default: ClassVar[bool] = False
    accepts: ClassVar[str] = TORCH
    produces: ClassVar[str] = TORCH

    def apply(self, model: nn.Module) -> PassResult:
        """Transform ``model`` and return it with details for the report."""
        raise NotImplementedError

    def check_run(self, steps: Sequence[Any]) -> None:
        """Rules that involve the run's other steps, checked when a pipeline is built (default: none).

        Args:
            steps: every step of the pipeline, in order, this one among them.

        Raises:
            OptkitError: naming the steps that cannot run together and what to do.
        """

    def bind(self, context: RunContext) -> Pass:
        """This pass with what it takes from the run's context filled in; a pipeline calls it before running.

        By default its unset ``checkpoint``, ``resume`` and ``teacher`` run options are filled
        (see :mod:`optkit.core.context`); passes that need more override this.

        Args:
            context: the run's context.

        Returns:
            the pass to run (``self`` when nothing changes).
        """
        from optkit.core.context import fill_run_options

        return fill_run_options(self, context)

    def __call__(self, model: nn.Module) -> nn.Module:
        return self.apply(model).model

    def settings(self) -> dict[str, Any]:
        """The pass's recipe settings as plain values (tuples become lists; unset ones and run options are left out)."""
        values = {}
        for f in dataclasses.fields(self):
            spec = declared(f)
            value = getattr(self, f.name)
            if value is None or not f.init or (spec is not None and not spec.recipe):
                continue
            values[f.name] = _plain(value)
        return values


def recipe_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a pass class that recipes hold, by recipe key (``global_`` is written ``global``)."""
    fields = {}
    for f in dataclasses.fields(cls):
        spec = declared(f)
        if f.init and (spec is None or spec.recipe):
            fields[f.name.rstrip("_")] = f
    return fields


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
