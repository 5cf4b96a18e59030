"""Int attributes that store the width of a child layer, written back after pruning.

Modules often keep the width of a layer they own as a plain int and use it in
forward (``x.reshape(B * n, self.in_dim, -1)`` after ``self.proj``, a conv
with ``in_dim`` outputs). Pruning the layer leaves the int stale and the
reshape fails. An int attribute whose name says it is a width (``dim``,
``channels``, ``features``, ``width``) and whose value is the output width of
exactly one direct child conv or linear is taken to follow that layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

WIDTH_WORDS = ("dim", "channels", "features", "width")


@dataclass
class WidthAttribute:
    """``module.name`` holds ``layer``'s output width."""

    module: Any
    name: str
    layer: Any

    def write_back(self) -> None:
        """Set the attribute to the layer's current output width."""
        setattr(self.module, self.name, _out_width(self.layer))


def width_attributes(model: nn.Module, skip: set) -> list[WidthAttribute]:
    """The width attributes of ``model``'s modules (see the module docstring), leaving out modules in ``skip``."""
    found = []
    for module in model.modules():
        if module in skip:
            continue
        children = [c for c in module.children() if _out_width(c) is not None]
        if not children:
            continue
        for name, value in vars(module).items():
            if type(value) is not int or not any(word in name for word in WIDTH_WORDS):
                continue
            owners = [c for c in children if _out_width(c) == value]
            if len(owners) == 1:
                found.append(WidthAttribute(module, name, owners[0]))
    return found


def _out_width(layer: nn.Module) -> int | None:
    from torch import nn

    if isinstance(layer, nn.modules.conv._ConvNd):
        return layer.out_channels
    if isinstance(layer, nn.Linear):
        return layer.out_features
    return None
