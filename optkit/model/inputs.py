"""Example inputs: what a model of any kind runs on, reproducibly, for counting, tracing and checking."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from optkit.kinds import example_inputs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["example_input"]


def example_input(model: nn.Module, input_shape: Sequence[int], *, seed: int = 0) -> Any:
    """A reproducible example input of ``input_shape`` on the model's device, such that ``model(x)`` runs.

    What it is depends on the model's kind (:func:`optkit.kinds.kind_of`): an
    image batch, token ids, or a list of images. :func:`optkit.kinds.example_inputs`
    gives the whole call (an attention mask too).
    """
    return example_inputs(model, input_shape, seed=seed).first()
