"""A model's state around a computation: its train/eval mode, caches holding autograd history, its submodules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["detach_caches", "eval_mode", "set_submodule"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block, then restore the train/eval mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def detach_caches(model: nn.Module) -> nn.Module:
    """Detach, in place, tensors ``model``'s modules keep outside their parameters and buffers (a cache filled by a
    forward pass, such as attention biases gathered in eval mode) that carry autograd history: deep copies of the
    model, which every trial prune makes, refuse such tensors. Returns ``model``."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    def detached(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) and not value.is_leaf else value

    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor | dict | list | tuple) and not name.startswith("_"):
                leaves = tree_leaves(value)
                if any(isinstance(leaf, torch.Tensor) and not leaf.is_leaf for leaf in leaves):
                    setattr(module, name, tree_map(detached, value))
    return model


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` in place of ``model``'s submodule at the dotted ``path`` (as its parent's attribute)."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)
