"""Attention heads of a model whose config states a head count per stage, cut to what the edited config builds.

In a model such as a Hugging Face Swin, an attention's inner width is its
stage's width, split into ``num_heads[stage]`` heads; :mod:`.config_widths`
narrows the stage widths (``embed_dim``), which leaves the attention
interiors to this module. Where a stage's new width is a whole number of the
old head widths, whole heads go and the kept ones keep their width; elsewhere
the head count stays and every head loses the same number of dims.

* **Units** (the attention modules, their projections and head layout) are
  found by :mod:`.head_units`.
* **Head-count fields** are found by their outcome: setting an element of a
  config field to 1 must change only the head counts of units that had that
  many heads (to 1) and only their per-head parameters. Width edits are then
  tried with every such element at 1 (one head splits any width), and the
  counts are chosen last from the widths the edit gives.
* **Cutting** keeps the heads with the largest summed L1 norm of their
  weights (input rows and output columns), and in every kept head the dims
  ranked the same way; the same dims go from every projection, so query-key
  products and value-output paths stay aligned. :func:`.transformer.engine.matches_stock`
  then copies the class's derived settings (head width, score scaling).
  Narrower heads so get the stock class's scaling for their new width
  (``1 / sqrt(d')`` instead of ``1 / sqrt(d)``); the query and key parts
  (found by probe: doubling a value part doubles the output projection's
  input) are rescaled so that the kept dims' scores stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.hf.head_units import Interior, head_count, select_heads

if TYPE_CHECKING:
    import torch
    from torch import nn

Shapes = dict[str, tuple[int, ...]]
# a built candidate: parameter shapes, output shapes, and the model (on the meta device)
Build = Callable[[dict[str, Any]], "tuple[Shapes, Any, nn.Module] | None"]

@dataclass(frozen=True)
class HeadFields:
    """The config elements that set the units' head counts: (field, index in its list, or ``None`` for an int)
    -> the names of the units whose head count it is."""

    elements: dict[tuple[str, int | None], tuple[str, ...]]

    def pinned(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` with one head in every unit, which splits any width: width edits are tried so."""
        return self._with(fields, dict.fromkeys(self.elements, 1))

    def split(self, fields: dict[str, Any], units: list[Interior], built: tuple[Shapes, Any, nn.Module]
              ) -> dict[str, Any] | None:
        """``fields`` with every element at the head count its units' widths in ``built`` take: whole heads of
        their old width where the new width is a whole number of them, else the old count (narrower heads);
        ``None`` when some unit's new width takes neither.

        One element may set the head count of units of different widths (MobileViT's one ``num_attention_heads``
        for every stage): the count must then suit every unit's new width, whole heads where all of them allow
        the same number, else the old count with narrower heads in each."""
        by_name = {unit.name: unit for unit in units}
        counts = {}
        for element, names in self.elements.items():
            allowed = None
            for name in names:
                unit = by_name[name]
                width = built[0][f"{unit.output}.weight"][1]
                options = {width // unit.head_dim} if width % unit.head_dim == 0 and width // unit.head_dim <= \
                    unit.heads else set()
                options |= {unit.heads} if width % unit.heads == 0 else set()
                allowed = options if allowed is None else allowed & options
            if not allowed:
                return None
            counts[element] = min(allowed)
        return self._with(fields, counts)

    @staticmethod
    def _with(fields: dict[str, Any], counts: dict[tuple[str, int | None], int]) -> dict[str, Any]:
        edited = dict(fields)
        for (key, index), count in counts.items():
            edited[key] = count if index is None else _replaced(edited[key], index, count)
        return edited


def find_head_fields(units: list[Interior], fields: dict[str, Any], built: tuple[Shapes, Any, nn.Module],
                     build: Build, *, stage: str = "structured_prune", deadline: float | None = None) -> HeadFields:
    """The elements of ``fields`` (which ``built``) that set units' head counts, found by setting each int
    element equal to some unit's head count to 1: it is one when only those units' head counts change (to 1),
    and only their per-head parameters, with the same output shapes.

    Each probe builds the stock class once, shown as progress under ``stage``; past ``deadline`` (a
    ``time.monotonic()`` value) no more are tried, and the elements found by then are the answer."""
    import time

    from optkit.core.progress import progress

    counts = {unit.heads for unit in units if unit.heads > 1}
    elements: dict[tuple[str, int | None], tuple[str, ...]] = {}
    probes = [(key, value, index, element) for key, value in fields.items()
              for index, element in enumerate(value if isinstance(value, list | tuple) else [value])
              if type(element) is int and element in counts]
    shown = progress(stage, "config fields tried as head counts", len(probes))
    for key, value, index, element in probes:
        if deadline is not None and time.monotonic() > deadline:
            break
        shown.step(detail=key)
        listed = isinstance(value, list | tuple)
        probe = build({**fields, key: _replaced(value, index, 1) if listed else 1})
        changed = _changed_heads(units, built, probe) if probe is not None else None
        if changed and all(before == element and after == 1 for before, after in changed.values()):
            elements[(key, index if listed else None)] = tuple(changed)
    return HeadFields(elements)


def _replaced(value: Any, index: int, count: int) -> Any:
    return type(value)(count if i == index else v for i, v in enumerate(value))


def heads_differ_only(units: list[Interior], before: tuple[Shapes, Any, nn.Module],
                      after: tuple[Shapes, Any, nn.Module]) -> bool:
    """Whether ``after`` differs from ``before`` only in units' head counts and the per-head parameters of those
    units (outputs of the same shapes)."""
    return _changed_heads(units, before, after) is not None


def _changed_heads(units: list[Interior], before: tuple[Shapes, Any, nn.Module],
                   after: tuple[Shapes, Any, nn.Module]) -> dict[str, tuple[int, int]] | None:
    """Unit name -> (heads before, after) for the units whose head count differs, if nothing else but those
    units' per-head parameters (along axes of those lengths) differs; else ``None``."""
    if after[1] != before[1] or after[0].keys() != before[0].keys():
        return None
    changed = {}
    for unit in units:
        counts = (head_count(before[2].get_submodule(unit.name)), head_count(after[2].get_submodule(unit.name)))
        if counts[0] != counts[1]:
            changed[unit.name] = counts
    owners = {unit.name: unit for unit in units if unit.name in changed}
    for name, shape in after[0].items():
        old = before[0][name]
        if shape == old:
            continue
        unit = next((u for n, u in owners.items() if name.startswith(f"{n}.")), None)
        if unit is None or name.rpartition(".")[0] in {unit.output, *(p for p, _ in unit.projections)}:
            return None
        if len(shape) != len(old) or any(o != s and (o, s) != changed[unit.name] for o, s in zip(old, shape)):
            return None
    return changed


def targets(units: list[Interior], built: tuple[Shapes, Any, nn.Module], model: nn.Module
            ) -> dict[str, tuple[int, int, float]]:
    """Unit name -> (heads, inner width, score factor) in the model ``built``, for the units that change.

    The score factor is how the built class rescales the unit's scores against ``model``'s: the ratio of the
    one float setting of the unit's module that differs (a ``scaling`` of ``head_dim ** -0.5``), else 1.
    """
    found = {}
    for unit in units:
        fresh = built[2].get_submodule(unit.name)
        heads, width = head_count(fresh), built[0][f"{unit.output}.weight"][1]
        if (heads, width) != (unit.heads, unit.width) and heads >= 1 and width % heads == 0:
            mine = vars(model.get_submodule(unit.name))
            changed = [value / mine[key] for key, value in vars(fresh).items()
                       if type(value) is float and type(mine.get(key)) is float and mine[key] and value != mine[key]]
            found[unit.name] = (heads, width, changed[0] if len(changed) == 1 else 1.0)
    return found


def cut(model: nn.Module, units: list[Interior], wanted: dict[str, tuple[int, int, float]]) -> None:
    """Cut each unit of ``model`` named in ``wanted`` to its (heads, width), keeping the strongest heads and dims.

    Where the class will rescale the scores by a factor (narrower heads: ``1/sqrt(d')`` for ``1/sqrt(d)``), the
    query and key parts are scaled by its inverse square root each, so the kept dims' scores stay as they were.
    """
    import torch

    for unit in units:
        if unit.name not in wanted:
            continue
        heads, width, factor = wanted[unit.name]
        score = model.get_submodule(unit.output).weight.detach().abs().sum(0)
        for name, parts in unit.projections:
            weight = model.get_submodule(name).weight.detach().abs().sum(1)
            score = score + weight.view(parts, unit.width).sum(0)
        per_head = score.view(unit.heads, unit.head_dim)
        kept = per_head.sum(1).topk(heads).indices.sort().values
        dims = per_head[kept].topk(width // heads, dim=1).indices.sort(dim=1).values
        select_heads(model, unit, kept, dims, heads != unit.heads)
        if factor != 1.0 and len(unit.scores) == 2:
            with torch.no_grad():
                for name, part in unit.scores:
                    linear = model.get_submodule(name)
                    rows = slice(part * width, (part + 1) * width)
                    linear.weight[rows] *= factor ** -0.5
                    if linear.bias is not None:
                        linear.bias[rows] *= factor ** -0.5
