"""The run context: what a pass may need besides the model and its settings, in one object.

A :class:`~optkit.core.pipeline.Pipeline` binds every step to the context
before the first one runs (:meth:`RunContext.bind`), so a pass that learns from
the model as it was before the pipeline gets a copy made before any pass
changed it. A pass takes what it needs in :meth:`optkit.core.contract.Pass.bind`;
by default, its unset run options (settings that recipes never hold) named
after what the context supplies:

* ``checkpoint``: a file in the output folder named after the pass
  (``finetune.ckpt``; ``finetune-2.ckpt`` for the second of several);
* ``resume``: the run's ``resume``;
* ``teacher``: the teacher, or a copy of the model before the pipeline, unless
  the pass's ``wants_teacher`` says it will not use one.

Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunContext:
    """One pipeline run's context.

    Attributes:
        out_dir: the run's output folder, for files that must outlive an interrupted run (training
            checkpoints); ``None`` when the run has none.
        files_dir: where passes write the files the run publishes (ONNX, INT8); ``None``: ``out_dir``.
            ``optkit optimize`` gives a staging folder that is published with the other outputs.
        teacher: the model to learn from; ``None``: a copy of the model before the pipeline.
        resume: whether interrupted training continues from its checkpoints.
        rank: this process's rank in a distributed run (0 otherwise).
        world_size: the number of processes in the run.
        data: the input normalization (``{"mean": ..., "std": ...}``) of each dataset spec the passes read.
        plan: what an earlier step decided that a later one carries out (the deployment a latency budget chose,
            and the frontier it was chosen from, for ``deploy``).
    """

    out_dir: Path | None = None
    files_dir: Path | None = None
    teacher: Any = None
    resume: bool = False
    rank: int = 0
    world_size: int = 1
    data: dict[str, dict[str, str]] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    _input: Any = field(default=None, init=False, repr=False)
    _steps: Sequence[Any] = field(default=(), init=False, repr=False)
    _step: tuple[str, int, int] = field(default=("", 1, 1), init=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    def original(self) -> Any:
        """The teacher: :attr:`teacher` when given, else a copy (in eval mode) of the model before the pipeline.

        Raises:
            RuntimeError: outside :meth:`bind`, when no teacher was given (the model before the pipeline is
                known only while the steps are bound).
        """
        if self.teacher is None:
            if self._input is None:
                raise RuntimeError("the model before the pipeline is known only while a pipeline binds its steps")
            self.teacher = copy.deepcopy(self._input).eval()
        return self.teacher

    def step(self, name: str) -> Any:
        """The run's first step named ``name`` (unbound), or ``None``; known only while a pipeline binds its steps,
        so a step may depend on one after it (a latency budget is met in the run's ``deploy``)."""
        return next((step for step in self._steps if getattr(step, "name", None) == name), None)

    def output_path(self, name: str) -> Path:
        """Where a pass writes the published file ``name`` (in :attr:`files_dir`, else :attr:`out_dir`, else here)."""
        folder = self.files_dir or self.out_dir
        return Path(folder) / name if folder is not None else Path(name)

    def step_file(self, suffix: str) -> Path | None:
        """A file in :attr:`out_dir` named after the step being bound (``finetune.ckpt``, ``finetune-2.ckpt``)."""
        if self.out_dir is None:
            return None
        name, number, count = self._step
        return Path(self.out_dir) / (f"{name}{suffix}" if count == 1 else f"{name}-{number}{suffix}")

    def bind(self, steps: Sequence[Any], model: Any) -> list[Any]:
        """Each step with what it takes from this context (see :meth:`optkit.core.contract.Pass.bind`).

        Args:
            steps: the pipeline's steps, before any of them ran; plain callables stay as they are.
            model: the model the pipeline is about to run on (the teacher is copied from it if a step wants one).

        Returns:
            the bound steps, in order.
        """
        counts = Counter(getattr(step, "name", None) for step in steps)
        seen: Counter = Counter()
        bound = []
        self._input, self._steps = model, tuple(steps)
        try:
            for step in steps:
                name = getattr(step, "name", None)
                if not callable(getattr(step, "bind", None)) or name is None:
                    bound.append(step)
                    continue
                seen[name] += 1
                self._step = (name, seen[name], counts[name])
                bound.append(step.bind(self))
        finally:
            self._input, self._steps = None, ()
        return bound


def fill_run_options(step: Any, context: RunContext) -> Any:
    """``step`` with its unset ``checkpoint``, ``resume`` and ``teacher`` run options taken from ``context``.

    Only fields that recipes never hold are filled (see the module docstring).
    """
    from optkit.core.settings import declared

    run_options = {f.name for f in dataclasses.fields(step) if f.init and (spec := declared(f)) is not None
                   and not spec.recipe}
    values: dict[str, Any] = {}
    if "checkpoint" in run_options and step.checkpoint is None and context.out_dir is not None:
        values["checkpoint"] = str(context.step_file(".ckpt"))
    if "resume" in run_options and context.resume and not step.resume:
        values["resume"] = True
    if "teacher" in run_options and step.teacher is None and getattr(step, "wants_teacher", True):
        values["teacher"] = context.original()
    return dataclasses.replace(step, **values) if values else step
