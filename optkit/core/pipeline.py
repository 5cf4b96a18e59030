"""Run passes in order, name the one that fails, and record what each changed."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from optkit.analysis.metrics import ModelStats, measure
from optkit.core import recipe
from optkit.core.contract import DEFAULT_INPUT_SHAPE, SHARED_SETTINGS, Pass, PassResult, check_input_shape
from optkit.core.errors import OptkitError, PassError, RecipeError
from optkit.core.settings import check_device
from optkit.io.files import write_text

#: A pipeline step: a registered-style :class:`Pass`, or any callable ``model -> model``.
Step = Pass | Callable[[nn.Module], nn.Module]


@dataclass
class PassRecord:
    """Measurements after one pass.

    Attributes:
        name: the pass's registered name, or a plain callable's ``__name__``.
        seconds: wall time of the pass itself (measurement excluded).
        stats: params, MACs and sparsity after the pass, or ``None`` when not measured.
        details: what the pass reported (e.g. layers it left untouched).
    """

    name: str
    seconds: float
    stats: ModelStats | None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "seconds": round(self.seconds, 4)}
        if self.stats is not None:
            out.update(self.stats.to_dict())
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class PipelineRun:
    """The outcome of :meth:`Pipeline.run`."""

    model: nn.Module
    before: ModelStats | None
    after: ModelStats | None
    records: list[PassRecord]


class Pipeline:
    """An ordered list of passes with the settings they share.

    Args:
        passes: the steps to run, in order: :class:`Pass` instances or any
            callable ``model -> model`` (timed, measured and reported under its
            ``__name__``; plain callables have no recipe form).
        input_shape: example input shape given to every pass that takes one
            and leaves it unset, and used to count MACs.
        device: device given to every pass that takes one and leaves it unset.
        int8: INT8 settings for the exported ONNX model (a recipe's ``[int8]`` table); the
            passes do not read them, ``optkit optimize --export onnx`` does.

    Example::

        pipeline = Pipeline([StructuredPrune(ratio=0.3)], input_shape=(1, 3, 224, 224))
        result = pipeline.run(model)
    """

    def __init__(self, passes: Sequence[Step], *, input_shape: Sequence[int] | None = None,
                 device: str | None = None, int8: Any = None):
        self.passes = list(passes)
        #: INT8 settings (:class:`optkit.passes.quantize.Int8Settings`) for the exported model, or ``None``.
        self.int8 = int8
        for index, step in enumerate(self.passes, start=1):
            if not isinstance(step, Pass) and not callable(step):
                raise TypeError(f"pipeline step {index} is a {type(step).__name__}, not a Pass or a callable model -> model")
        #: Whether the input shape was given (else it may be inferred from the model, see ``optkit optimize``).
        self.input_shape_given = input_shape is not None
        self.input_shape = check_input_shape(input_shape) or DEFAULT_INPUT_SHAPE
        self.device = check_device(device)
        #: What loading the recipe said, e.g. that an older recipe version was migrated.
        self.notes: list[str] = []

    def resolved_passes(self) -> list[Step]:
        """The steps with the pipeline's shared settings filled in where a pass leaves them unset."""
        shared = {"input_shape": self.input_shape, "device": self.device}
        resolved = []
        for p in self.passes:
            if not isinstance(p, Pass):
                resolved.append(p)
                continue
            names = {f.name for f in dataclasses.fields(p)}
            fill = {k: shared[k] for k in SHARED_SETTINGS
                    if k in names and getattr(p, k) is None and shared[k] is not None}
            resolved.append(dataclasses.replace(p, **fill) if fill else p)
        return resolved

    def run(self, model: nn.Module, *, measure_stats: bool = True,
            on_pass: Callable[[int, int, str], None] | None = None,
            after_pass: Callable[[PassRecord, nn.Module], None] | None = None) -> PipelineRun:
        """Run every pass in order.

        Args:
            model: the model; passes may change it in place.
            measure_stats: count params, MACs and sparsity before and after each pass.
            on_pass: called as ``on_pass(index, total, name)`` before each pass (progress).
            after_pass: called as ``after_pass(record, model)`` after each pass (e.g. to evaluate the model).

        Returns:
            the final model, the stats before and after, and a record per pass.

        Raises:
            PassError: naming the failing pass and those that ran before it.
        """
        before = measure(model, self.input_shape) if measure_stats else None
        records: list[PassRecord] = []
        passes = self._with_teacher(self.resolved_passes(), model)
        for index, p in enumerate(passes):
            name = step_name(p)
            if on_pass is not None:
                on_pass(index, len(passes), name)
            start = time.perf_counter()
            try:
                result = _apply(p, model)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                raise PassError(name, [r.name for r in records], e) from e
            seconds = time.perf_counter() - start
            model = result.model
            stats = self._measure_after(name, model, records) if measure_stats else None
            records.append(PassRecord(name, seconds, stats, result.details))
            if after_pass is not None:
                after_pass(records[-1], model)
        after = records[-1].stats if records else before
        return PipelineRun(model, before, after, records)

    @staticmethod
    def _with_teacher(passes: list[Step], model: nn.Module) -> list[Step]:
        # Distillation learns from the model as it was before any pass changed it in place.
        if not any(getattr(p, "wants_teacher", False) for p in passes):
            return passes
        teacher = copy.deepcopy(model).eval()
        return [dataclasses.replace(p, teacher=teacher) if getattr(p, "wants_teacher", False) else p for p in passes]

    def _measure_after(self, name: str, model: nn.Module, records: list[PassRecord]) -> ModelStats:
        try:
            return measure(model, self.input_shape)
        except OptkitError:
            raise
        except Exception as e:
            raise PassError(name, [r.name for r in records], RuntimeError(f"the model no longer runs after this pass: {e}")) from e

    def to_toml(self) -> str:
        """The pipeline as recipe TOML (see :mod:`optkit.core.recipe`).

        Raises:
            RecipeError: naming the first step that is a plain callable (it has no recipe form).
        """
        for index, step in enumerate(self.passes, start=1):
            if not isinstance(step, Pass):
                raise RecipeError(f"step {index} ({step_name(step)}) is a plain callable and has no recipe form; "
                                  "make it a Pass subclass with @register_pass to save this pipeline as a recipe")
        sections = {"int8": self.int8} if self.int8 is not None else None
        return recipe.dumps(self.passes, input_shape=self.input_shape, device=self.device, sections=sections)

    def save(self, path: str | os.PathLike) -> None:
        """Atomically write the pipeline as a recipe file."""
        write_text(path, self.to_toml())

    @classmethod
    def from_toml(cls, text: str, *, source: str = "recipe") -> Pipeline:
        """Build a pipeline from recipe TOML; only registered pass names load."""
        return cls._from_parsed(recipe.parse(text, source=source))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "recipe") -> Pipeline:
        """Build a pipeline from an already-parsed recipe mapping (what CLI flags produce)."""
        return cls._from_parsed(recipe.from_dict(data, source=source))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Pipeline:
        """Build a pipeline from a recipe file."""
        return cls._from_parsed(recipe.load(path))

    @classmethod
    def _from_parsed(cls, parsed: dict[str, Any]) -> Pipeline:
        pipeline = cls(parsed["passes"], input_shape=parsed["input_shape"], device=parsed["device"],
                       int8=parsed["sections"].get("int8"))
        pipeline.notes = list(parsed["notes"])
        return pipeline

    def __repr__(self) -> str:
        names = ", ".join(step_name(p) for p in self.passes)
        return f"Pipeline([{names}], input_shape={self.input_shape})"


def step_name(step: Step) -> str:
    """A step's name in reports: a pass's registered name, else the callable's ``__name__``."""
    if isinstance(step, Pass):
        return step.name
    target = getattr(step, "func", step)  # functools.partial
    return getattr(target, "__name__", None) or type(step).__name__


def _apply(step: Step, model: nn.Module) -> PassResult:
    if isinstance(step, Pass):
        return step.apply(model)
    returned = step(model)
    if not isinstance(returned, nn.Module):
        raise TypeError(f"{step_name(step)} returned {type(returned).__name__}; a pass must return the model")
    return PassResult(returned)
