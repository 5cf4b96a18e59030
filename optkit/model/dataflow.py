"""Which module feeds which: the data flow between a model's submodules.

The BatchNorm passes and the folding engine (:mod:`optkit.model.batchnorm`)
decide "this conv is followed by a norm layer" and "this BN reads only that
conv" from the data flow, not from module order (a
module's position in ``named_modules()`` says nothing about where its output
goes: branches, concatenations and shared layers break that assumption).

Two ways to get it, tried in order:

1. **torch.fx** symbolic tracing, which needs no input and sees every
   operation, but fails on data-dependent control flow;
2. **the autograd graph** of one eval-mode forward pass on an example input:
   forward hooks on leaf modules record which autograd node each module's
   output came from, and walking the graph back from the outputs gives every
   consumer, including functional ops (``torch.cat``, ``x + y``) that hooks
   alone cannot see. It needs a model that runs on the example input with
   gradients enabled.

Consumers and producers that are not modules are labelled ``op:NAME``; the
model's inputs and outputs are ``input`` and ``output``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

INPUT = "input"
OUTPUT = "output"


@dataclass
class DataFlow:
    """The data flow between a model's submodules.

    Attributes:
        method: ``"fx"`` or ``"autograd"``, how it was found.
        calls: module name -> how many times it ran in one forward pass.
        users: module name -> labels of what consumes its output.
        producers: module name -> labels of what produced its tensor inputs.
        fx_error: why torch.fx tracing failed, when the autograd graph was used.
    """

    method: str
    calls: Counter = field(default_factory=Counter)
    users: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    producers: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    fx_error: str | None = None

    def details(self) -> dict[str, Any]:
        """How the flow was found, for a pass's details: ``dataflow`` (the method) and ``fx_error`` when fx failed."""
        details: dict[str, Any] = {"dataflow": self.method}
        if self.fx_error:
            details["fx_error"] = self.fx_error
        return details


def data_flow(model: nn.Module, example: torch.Tensor | None) -> DataFlow:
    """The data flow of ``model``: from torch.fx, or from the autograd graph when fx cannot trace it.

    Args:
        model: the model (left in the training mode it had).
        example: an input the model runs on; used only when fx tracing fails.

    Raises:
        ValueError: if fx cannot trace the model and no example input was given.
    """
    try:
        return _fx_flow(model)
    except Exception as e:
        fx_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if example is None:
        raise ValueError(f"torch.fx cannot trace the model ({fx_error}) and no example input was given")
    flow = _autograd_flow(model, example)
    flow.fx_error = fx_error
    return flow


def _fx_flow(model: nn.Module) -> DataFlow:
    import torch.fx

    graph = torch.fx.symbolic_trace(model).graph
    flow = DataFlow("fx")
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        flow.calls[node.target] += 1
        flow.users[node.target].update(_fx_label(user) for user in node.users)
        flow.producers[node.target].update(_fx_label(arg) for arg in node.all_input_nodes)
    return flow


def _fx_label(node: Any) -> str:
    if node.op == "call_module":
        return node.target
    if node.op == "placeholder":
        return INPUT
    if node.op == "output":
        return OUTPUT
    if node.op == "get_attr":
        return f"attr:{node.target}"
    return f"op:{getattr(node.target, '__name__', node.target)}"


def _autograd_flow(model: nn.Module, example: torch.Tensor) -> DataFlow:
    import torch

    from optkit.model.state import eval_mode

    flow = DataFlow("autograd")
    owner: dict[Any, str] = {}
    kept: list[Any] = []

    def record(name: str):
        def hook(module, args, output):
            flow.calls[name] += 1
            for tensor in _tensors(output):
                # The first module to produce a node owns it: Identity and eval-mode
                # Dropout return their input unchanged and must not claim it.
                if tensor.grad_fn is not None and tensor.grad_fn not in owner:
                    owner[tensor.grad_fn] = name
            kept.append(output)
        return hook

    leaves = [(name, m) for name, m in model.named_modules() if name and not any(True for _ in m.children())]
    handles = [m.register_forward_hook(record(name)) for name, m in leaves]
    try:
        with eval_mode(model), torch.enable_grad():
            outputs = model(example)
    finally:
        for handle in handles:
            handle.remove()

    def label(node: Any) -> str:
        return owner.get(node) or f"op:{type(node).__name__}"

    node_users: dict[Any, set[str]] = defaultdict(set)
    children: dict[Any, list[Any]] = {}
    stack = []
    for tensor in _tensors(outputs):
        node_users[tensor.grad_fn].add(OUTPUT)
        stack.append(tensor.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or node in children:
            continue
        # None marks an input that needs no gradient: the model's input, or an
        # absent bias; parameters end in AccumulateGrad nodes.
        children[node] = [n for n, _ in node.next_functions if n is not None and type(n).__name__ != "AccumulateGrad"]
        for child in children[node]:
            node_users[child].add(label(node))
            stack.append(child)
    for node, name in owner.items():
        flow.users[name].update(node_users.get(node, ()))
        flow.producers[name].update([label(child) for child in children.get(node, [])] or [INPUT])
    return flow


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
