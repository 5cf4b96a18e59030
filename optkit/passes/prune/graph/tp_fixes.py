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


def root_types() -> list[type]:
    """The layer types whose output channels root dependency groups."""
    from torch import nn

    return [nn.modules.conv._ConvNd, nn.Linear]


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


#: How often one dependency group may reach the same layer (same pruning function) for the same channels of its
#: root with other indices before its walk is taken for one that never ends.
REVISITS = 8


class GroupDoesNotConverge(RuntimeError):
    """torch-pruning's walk for one dependency group keeps reaching the same layer with shifted indices."""


_active: list[bool] = []


@contextlib.contextmanager
def converging_groups(stage: str = "structured_prune") -> Iterator[None]:
    """While active, torch-pruning's dependency groups are built in bounded time, with progress shown.

    torch-pruning builds a group by walking the graph from its root, adding every layer and op the root's
    channels reach, and stops at a node it has already reached with the same indices. Around a cycle through a
    broadcast product and a slice (FocalNet's modulation: ``ctx * gates[:, l:l+1]`` summed over levels) the
    slice's index mapping shifts the indices every time round, so the walk never stops: minutes for a
    1.4 M-parameter FocalNet, while the group and each membership test grow without bound. Here a node reached
    :data:`REVISITS` times for the same root channels raises :class:`GroupDoesNotConverge` at once, and
    membership is tested through an index instead of a scan of the group. Listing every group (what the
    pruner does when it starts and at each step) leaves such a group out, so its root keeps its width and the
    other groups prune; building it alone raises (the fallback search then holds it).

    Each group built counts toward one progress line per graph (``stage: dependency groups built n/N``).
    Nested uses share the outermost one.
    """
    if _active:
        yield
        return
    from torch_pruning.dependency import graph as tp_graph
    from torch_pruning.dependency import group as tp_group

    from optkit.core.progress import progress

    group_class, graph_class = tp_group.Group, tp_graph.DependencyGraph
    original_add, original_has, original_build = group_class.add_dep, group_class.has_pruning_op, \
        graph_class.get_pruning_group
    original_all = graph_class.get_all_groups
    counts: dict[int, Any] = {}

    def keys(dep: Any, idxs: Any) -> tuple[tuple, tuple]:
        node = (id(dep.target), dep.handler)
        return (*node, tuple(idxs)), (*node, tuple(getattr(i, "root_idx", i) for i in idxs))

    def add_dep(self: Any, dep: Any, idxs: Any) -> None:
        original_add(self, dep, idxs)
        exact, roots = keys(dep, idxs)
        seen = self.__dict__.setdefault("_optkit_seen", (set(), {}, [0]))
        seen[0].add(exact)
        seen[1][roots] = seen[1].get(roots, 0) + 1
        seen[2][0] += 1

    def has_pruning_op(self: Any, dep: Any, idxs: Any) -> bool:
        seen = self.__dict__.get("_optkit_seen")
        if seen is None or seen[2][0] != len(self._group):  # items added around add_dep: scan as torch-pruning does
            return original_has(self, dep, idxs)
        exact, roots = keys(dep, idxs)
        if exact in seen[0]:
            return True
        if seen[1].get(roots, 0) >= REVISITS:
            raise GroupDoesNotConverge(f"torch-pruning's dependency group does not converge: it reached "
                                       f"{dep.target} {REVISITS} times for the same channels, with other indices")
        return False

    def get_pruning_group(self: Any, *args: Any, **kwargs: Any) -> Any:
        shown = counts.get(id(self))
        if shown is None or shown.done >= shown.total:
            roots = tuple(root_types())
            total = sum(1 for m in self.module2node if isinstance(m, roots))
            shown = counts[id(self)] = progress(stage, "dependency groups built", max(total, 1))
        try:
            return original_build(self, *args, **kwargs)
        finally:
            shown.step()

    def get_all_groups(self: Any, ignored_layers: Any = (), root_module_types: Any = None) -> Iterator[Any]:
        """torch-pruning's ``get_all_groups``, leaving out the groups that do not converge."""
        from torch_pruning import ops

        types = tuple(root_module_types or (ops.TORCH_CONV, ops.TORCH_LINEAR))
        ignored = list(ignored_layers) + list(self.IGNORED_LAYERS_IN_TRACING)
        visited: set[int] = set()
        for module in list(self.module2node):
            if module in ignored or not isinstance(module, types) or id(module) in visited:
                continue
            pruner = self.get_pruner_of_module(module)
            if pruner is None or pruner.get_out_channels(module) is None:
                continue
            try:
                group = self.get_pruning_group(module, pruner.prune_out_channels,
                                               list(range(pruner.get_out_channels(module))))
            except GroupDoesNotConverge:
                continue
            prunable = True
            for dep, _ in group:
                if self.is_out_channel_pruning_fn(dep.handler):
                    visited.add(id(dep.target.module))
                    prunable = prunable and dep.target.module not in ignored
            if prunable:
                yield group

    group_class.add_dep, group_class.has_pruning_op = add_dep, has_pruning_op
    graph_class.get_pruning_group, graph_class.get_all_groups = get_pruning_group, get_all_groups
    _active.append(True)
    try:
        yield
    finally:
        _active.pop()
        group_class.add_dep, group_class.has_pruning_op = original_add, original_has
        graph_class.get_pruning_group, graph_class.get_all_groups = original_build, original_all
