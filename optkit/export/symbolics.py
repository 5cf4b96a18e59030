"""Symbolic functions the TorchScript ONNX exporter needs beyond its own, registered only while optkit exports.

- ``aten::expm1`` has no symbolic (activations such as xIELU use it): it is written ``Exp(x) - 1``.
- ``aten::repeat_interleave`` (rotary embeddings that interleave their frequencies, ``repeats=2, dim=-1``):
  the stock symbolic turns a negative ``dim`` positive by adding the rank *in place* on the constant's
  tensor, and TorchScript shares one constant node among all equal constants, so every other ``-1`` of the
  graph (``view(batch, seq, -1, head_dim)``) silently becomes that rank. Here ``dim`` is made non-negative
  on a fresh constant first, so the shared one is never touched.

:func:`exporter_symbolics` registers them for one opset and removes them afterwards; a symbolic the user
registered for the same op and opset is left in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: The stock symbolics fixed here appeared in these opsets.
REPEAT_INTERLEAVE_OPSET = 13


def _expm1(g: Any, self: Any) -> Any:
    import torch
    from torch.onnx._internal.torchscript_exporter import symbolic_helper, symbolic_opset9

    return symbolic_opset9.sub(g, g.op("Exp", self), symbolic_helper._if_scalar_type_as(torch.ones(1), self))


def _repeat_interleave(opset: int):
    def repeat_interleave(g: Any, self: Any, repeats: Any, dim: Any = None, output_size: Any = None) -> Any:
        import torch
        from torch.onnx._internal.torchscript_exporter import symbolic_helper, symbolic_opset9, symbolic_opset13

        if not symbolic_helper._is_none(dim):
            value = symbolic_helper._maybe_get_const(dim, "i")
            rank = symbolic_helper._get_tensor_rank(self)
            if isinstance(value, int) and value < 0 and rank is not None:
                dim = g.op("Constant", value_t=torch.tensor(value + rank))
        stock = symbolic_opset13 if opset >= REPEAT_INTERLEAVE_OPSET else symbolic_opset9
        return stock.repeat_interleave(g, self, repeats, dim, output_size)

    return repeat_interleave


@contextlib.contextmanager
def exporter_symbolics(opset: int) -> Iterator[None]:
    """Register optkit's symbolic functions for ``opset`` while the block runs (TorchScript exporter)."""
    from torch.onnx._internal.torchscript_exporter import registration

    symbolics = {"aten::expm1": _expm1, "aten::repeat_interleave": _repeat_interleave(opset)}
    added = []
    for name, function in symbolics.items():
        group = registration.registry.get_function_group(name)
        if group is not None and group._functions.overridden(opset):
            continue  # the user's own symbolic wins
        registration.registry.register(name, opset, function, custom=True)
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            registration.registry.unregister(name, opset)
