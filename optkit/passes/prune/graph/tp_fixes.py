"""Fixes for torch-pruning's graph building, active only while optkit traces a model.

torch-pruning 1.6 infers the channel count of each input of a concatenation
by walking the graph back to a layer. Where the walk finds none (an input
computed from parameters or through an op it cannot see through) the count is
``None`` and building the dependency graph fails with ``TypeError: unsupported
operand type(s) for +: 'int' and 'NoneType'``; where it passes a split it
may find the wrong one (a split's first part for its second), and pruning
then fails with an ``IndexError``. The traced autograd graph knows every
input's shape, so the counts are read from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def concat_sizes_from_autograd() -> Iterator[None]:
    """While active, torch-pruning takes the widths of concat inputs from the autograd graph."""
    from torch_pruning.dependency import index_mapping, shape_infer

    original = index_mapping.update_concat_index_mapping

    def update(graph: Any, cat_node: Any) -> Any:
        if cat_node.module.concat_sizes is None and cat_node.grad_fn is not None:
            traced = _input_widths(cat_node.grad_fn)
            if traced is not None and len(traced) == len(cat_node.inputs):
                cat_node.module.concat_sizes = traced
            elif None in [shape_infer.infer_channels_between(graph, n, cat_node) for n in cat_node.inputs]:
                return None  # what torch-pruning does when a width is unknown, minus the crash
        return original(graph, cat_node)

    index_mapping.update_concat_index_mapping = update
    try:
        yield
    finally:
        index_mapping.update_concat_index_mapping = original


def _input_widths(grad_fn: Any) -> list[int] | None:
    dim = getattr(grad_fn, "_saved_dim", 1)
    widths = []
    for fn, index in grad_fn.next_functions:
        if fn is None:
            continue
        metadata = getattr(fn, "_input_metadata", None)
        if metadata is None or index >= len(metadata) or len(metadata[index].shape) <= dim:
            return None
        widths.append(int(metadata[index].shape[dim]))
    return widths
