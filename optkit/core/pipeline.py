"""Run passes in order, name the one that fails, and record what each changed."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.core import forms, recipe
from optkit.core.context import RunContext
from optkit.core.contract import DEFAULT_INPUT_SHAPE, SHARED_SETTINGS, Pass, PassResult, check_input_shape
from optkit.core.errors import FormError, OptkitError, PassError, RecipeError
from optkit.core.files import write_text
from optkit.core.forms import TORCH
from optkit.core.memory import PeakRss
from optkit.core.settings import check_device

if TYPE_CHECKING:
    from torch import nn

    from optkit.model.stats import ModelStats

#: A pipeline step: a registered-style :class:`Pass`, or any callable ``model -> model`` (torch is not imported here).
Step = Pass | Callable[[Any], Any]


@dataclass
class PassRecord:
    """Measurements after one pass.

    Attributes:
        name: the pass's registered name, or a plain callable's ``__name__``.
        seconds: wall time of the pass itself (measurement excluded).
        stats: params, MACs and sparsity after the pass, or ``None`` when not measured (and after
            a pass that returns a file form, which has no PyTorch model to count).
        details: what the pass reported (e.g. layers it left untouched).
        form: the model form the pass returned (:mod:`optkit.core.forms`).
        peak_rss_mb: the process's peak resident memory while the pass ran, in MiB (see
            :mod:`optkit.core.memory`), or ``None`` where it cannot be read.
    """

    name: str
    seconds: float
    stats: ModelStats | None
    details: dict[str, Any] = field(default_factory=dict)
    form: str = TORCH
    peak_rss_mb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "seconds": round(self.seconds, 4)}
        if self.peak_rss_mb is not None:
            out["peak_rss_mb"] = self.peak_rss_mb
        if self.stats is not None:
            out.update(self.stats.to_dict())
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class PipelineRun:
    """The outcome of :meth:`Pipeline.run`.

    Attributes:
        model: the final model, in the form the last step returned.
        before: stats of the input model.
        after: stats of the last PyTorch model (a file form has none of its own).
        records: one per step that ran.
    """

    model: Any
    before: ModelStats | None
    after: ModelStats | None
    records: list[PassRecord]

    @property
    def torch_model(self) -> nn.Module:
        """The last PyTorch model: :attr:`model`, or the one a file form was exported from."""
        return forms.torch_model(self.model)

    def torch_part(self) -> PipelineRun:
        """This run as far as the PyTorch steps go: the records of steps that returned a PyTorch model."""
        return PipelineRun(self.torch_model, self.before, self.after,
                           [r for r in self.records if r.form == TORCH])


class Pipeline:
    """An ordered list of passes with the settings they share.

    Each step must take the model form the step before it returned (:mod:`optkit.core.forms`):
    PyTorch passes first, then an export step, then steps on the exported file (INT8).

    Args:
        passes: the steps to run, in order: :class:`Pass` instances or any
            callable ``model -> model`` (timed, measured and reported under its
            ``__name__``; plain callables have no recipe form and take PyTorch models).
        input_shape: example input shape given to every pass that takes one
            and leaves it unset, and used to count MACs.
        device: device given to every pass that takes one and leaves it unset.

    Raises:
        TypeError: for a step that is neither a Pass nor a callable.
        FormError: for a step that cannot take the form the step before it returns.
        OptkitError: for steps that cannot run together (see :meth:`Pass.check_run`).

    Example::

        pipeline = Pipeline([StructuredPrune(ratio=0.3)], input_shape=(1, 3, 224, 224))
        result = pipeline.run(model)
    """

    def __init__(self, passes: Sequence[Step], *, input_shape: Sequence[int] | None = None,
                 device: str | None = None):
        self.passes = list(passes)
        for index, step in enumerate(self.passes, start=1):
            if not isinstance(step, Pass) and not callable(step):
                raise TypeError(f"pipeline step {index} is a {type(step).__name__}, not a Pass or a callable model -> model")
        check_forms(self.passes)
        for step in self.passes:
            if isinstance(step, Pass):
                step.check_run(self.passes)
        #: Whether the input shape was given (else it may be inferred from the model, see ``optkit optimize``).
        self.input_shape_given = input_shape is not None
        self.input_shape = check_input_shape(input_shape) or DEFAULT_INPUT_SHAPE
        self.device = check_device(device)
        #: What loading the recipe said, e.g. that an older recipe version was migrated.
        self.notes: list[str] = []
        #: Where the input shape came from when it is not the caller's (``recipe FILE``), for error messages.
        self.input_shape_origin: str | None = None

    def writes_files(self) -> bool:
        """Whether a step turns the model into a file form (an export step)."""
        return any(isinstance(p, Pass) and p.produces != TORCH for p in self.passes)

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

    def run(self, model: nn.Module, *, context: RunContext | None = None, measure_stats: bool = True,
            on_pass: Callable[[int, int, str], None] | None = None,
            after_pass: Callable[[PassRecord, Any], None] | None = None) -> PipelineRun:
        """Run every pass in order.

        Every step is bound to ``context`` first (see :meth:`Pass.bind`). In a distributed run only
        rank 0 runs the steps that write files (export and those after it); the other ranks stop at
        the last PyTorch step.

        Args:
            model: the model; passes may change it in place.
            context: the run's context (output folder, teacher, resume, rank, data); default: an empty one.
            measure_stats: count params, MACs and sparsity before and after each PyTorch pass.
            on_pass: called as ``on_pass(index, total, name)`` before each pass (progress).
            after_pass: called as ``after_pass(record, model)`` after each pass (e.g. to evaluate the model),
                with the model in the form the pass returned.

        Returns:
            the final model, the stats before and after, and a record per pass.

        Raises:
            PassError: naming the failing pass and those that ran before it.
        """
        context = context if context is not None else RunContext()
        steps = self.resolved_passes()
        if not context.is_main:
            steps = [p for p in steps if not isinstance(p, Pass) or p.accepts == TORCH and p.produces == TORCH]
        before = _measure(model, self.input_shape) if measure_stats else None
        steps = context.bind(steps, model)
        records: list[PassRecord] = []
        after = before
        for index, p in enumerate(steps):
            name = step_name(p)
            if on_pass is not None:
                on_pass(index, len(steps), name)
            start = time.perf_counter()
            try:
                with PeakRss() as memory:
                    result = _apply(p, model)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                raise PassError(name, [r.name for r in records], e) from e
            seconds = time.perf_counter() - start
            model = result.model
            form = forms.form_of(model)
            stats = self._measure_after(name, model, records) if measure_stats and form == TORCH else None
            after = stats if stats is not None else after
            records.append(PassRecord(name, seconds, stats, result.details, form, memory.peak_mb))
            if after_pass is not None:
                after_pass(records[-1], model)
        return PipelineRun(model, before, after, records)

    def _measure_after(self, name: str, model: nn.Module, records: list[PassRecord]) -> ModelStats:
        try:
            return _measure(model, self.input_shape)
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
        return recipe.dumps(self.passes, input_shape=self.input_shape, device=self.device)

    def save(self, path: str | os.PathLike) -> None:
        """Atomically write the pipeline as a recipe file."""
        write_text(path, self.to_toml())

    @classmethod
    def from_toml(cls, text: str, *, source: str = "recipe") -> Pipeline:
        """Build a pipeline from recipe TOML; only registered pass names load."""
        return cls._from_parsed(recipe.parse(text, source=source), source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "recipe") -> Pipeline:
        """Build a pipeline from an already-parsed recipe mapping (what CLI flags produce)."""
        return cls._from_parsed(recipe.from_dict(data, source=source), source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Pipeline:
        """Build a pipeline from a recipe file."""
        return cls._from_parsed(recipe.load(path), os.fspath(path))

    @classmethod
    def _from_parsed(cls, parsed: dict[str, Any], source: str) -> Pipeline:
        try:
            pipeline = cls(parsed["passes"], input_shape=parsed["input_shape"], device=parsed["device"])
        except FormError as e:
            raise FormError(f"{source}: {e}") from e
        pipeline.notes = list(parsed["notes"])
        if parsed["input_shape"] is not None:
            pipeline.input_shape_origin = f"recipe {source}"
        return pipeline

    def __repr__(self) -> str:
        names = ", ".join(step_name(p) for p in self.passes)
        return f"Pipeline([{names}], input_shape={self.input_shape})"


def check_forms(steps: Sequence[Step]) -> None:
    """Check that each step takes the model form the step before it returns (a pipeline starts with PyTorch).

    Raises:
        FormError: naming the step, the form it takes, the form it would get and the step that made it.
    """
    form, maker = TORCH, None
    for index, step in enumerate(steps, start=1):
        accepts = step.accepts if isinstance(step, Pass) else TORCH
        if accepts != form:
            name = step_name(step)
            had = (f"{maker} before it returns {forms.describe(form)}" if maker
                   else f"the model is still {forms.describe(form)} there")
            fix = (f"put {name} before {maker}" if accepts == TORCH else
                   f"add {forms.made_by(accepts) or 'a step that makes one'} before it")
            raise FormError(f"step {index} ({name}) takes {forms.describe(accepts)}, but {had}: {fix}")
        if isinstance(step, Pass) and step.produces != form:
            form, maker = step.produces, step.name


def step_name(step: Step) -> str:
    """A step's name in reports: a pass's registered name, else the callable's ``__name__``."""
    if isinstance(step, Pass):
        return step.name
    target = getattr(step, "func", step)  # functools.partial
    return getattr(target, "__name__", None) or type(step).__name__


def _apply(step: Step, model: Any) -> PassResult:
    if isinstance(step, Pass):
        return step.apply(model)
    returned = step(model)
    from torch import nn

    if not isinstance(returned, nn.Module):
        raise TypeError(f"{step_name(step)} returned {type(returned).__name__}; a pass must return the model")
    return PassResult(returned)


def _measure(model: nn.Module, input_shape: tuple[int, ...]) -> ModelStats:
    # Counting needs torch and the model's kind: imported when a pipeline runs, so importing core stays torch-free.
    from optkit.model.stats import measure

    return measure(model, input_shape)
