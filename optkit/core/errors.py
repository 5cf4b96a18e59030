"""optkit's error hierarchy.

User mistakes (a bad value, a missing file) surface as one of these with a
message that says what was wrong and what to do. Failures inside a backend
(torch-pruning, the ONNX exporter) are wrapped ``from`` the original error so
the cause stays visible with ``--debug``.
"""

from __future__ import annotations


class OptkitError(Exception):
    """Base class for every error optkit raises on purpose."""


class ModelLoadError(OptkitError):
    """A model spec or checkpoint could not be read, or is not trusted."""


class UntrustedPickleError(ModelLoadError):
    """A file needs full unpickling (which can run code), and it was not trusted."""


class PassError(OptkitError):
    """A pass failed while running inside a pipeline.

    Attributes:
        pass_name: registered name of the pass that failed.
        completed: names of the passes that ran successfully before it.
    """

    def __init__(self, pass_name: str, completed: list[str], cause: BaseException):
        self.pass_name = pass_name
        self.completed = list(completed)
        before = ", ".join(self.completed) if self.completed else "none"
        detail = str(cause) or type(cause).__name__
        super().__init__(f"pass '{pass_name}' failed (passes completed before it: {before}): {detail}")


class FormError(OptkitError, TypeError):
    """A pipeline step cannot take the model form the step before it produced (a torch pass after export)."""


class RecipeError(OptkitError):
    """A recipe file is malformed or names unknown passes or settings."""


class ExportError(OptkitError):
    """ONNX export or its verification against PyTorch failed."""


class DataError(OptkitError):
    """A dataset spec is unknown, or its files are missing or malformed."""


class TrainingError(OptkitError):
    """Fine-tuning cannot go on: the loss stopped being finite, or a checkpoint does not fit the run."""


def first_line(error: BaseException, *, lines: int = 1, limit: int = 300) -> str:
    """An error's message cut to its first ``lines`` non-blank lines (joined by a space) and ``limit`` characters,
    for a one-line report; the error's class name when the message is empty."""
    kept = [line.strip() for line in str(error).strip().splitlines() if line.strip()][:lines]
    return " ".join(kept)[:limit] if kept else type(error).__name__
