"""Attention heads of a model whose config states a head count per stage, cut to what the edited config builds.

In a model such as a Hugging Face Swin, an attention's inner width is its
stage's width, split into ``num_heads[stage]`` heads; :mod:`.config_widths`
narrows the stage widths (``embed_dim``), which leaves the attention
interiors to this module. Where a stage's new width is a whole number of the
old head widths, whole heads go and the kept ones keep their width; elsewhere
the head count stays and every head loses the same number of dims.

* **Units** are found in one forward pass, never by name: a module with a
  head count attribute whose child linears are called as input projections
  ``C -> k * W`` (``k`` parts: separate q, k, v, or fused), closed by an
  output projection ``W -> C``: its last child linear, or else the first
  linear called after it returns (an output module beside it, as in BERT-style
  code). Their layout (``heads`` blocks of ``W / heads`` channels in every
  projection, per-head parameters with an axis ``heads`` long) is checked by
  trying it: shuffling the heads, and the dims inside each head in an order
  of its own, everywhere at once, must leave the output as it was.
* **Head-count fields** are found by their outcome: setting an element of a
  config field to 1 must change only the head counts of units that had that
  many heads (to 1) and only their per-head parameters. Width edits are then
  tried with every such element at 1 (one head splits any width), and the
  counts are chosen last from the widths the edit gives.
* **Cutting** keeps the heads with the largest summed L1 norm of their
  weights (input rows and output columns), and in every kept head the dims
  ranked the same way; the same dims go from every projection, so query-key
  products and value-output paths stay aligned. :func:`.engine.matches_stock`
  then copies the class's derived settings (head width, score scaling).
  Narrower heads so get the stock class's scaling for their new width
  (``1 / sqrt(d')`` instead of ``1 / sqrt(d)``); the query and key parts
  (found by probe: doubling a value part doubles the output projection's
  input) are rescaled so that the kept dims' scores stay as they were.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.attention import HEAD_COUNT_ATTRIBUTES, capture_calls
from optkit.passes.prune.opaque import select_linear

if TYPE_CHECKING:
    import torch
    from torch import nn

Shapes = dict[str, tuple[int, ...]]
# a built candidate: parameter shapes, output shapes, and the model (on the meta device)
Build = Callable[[dict[str, Any]], "tuple[Shapes, Any, nn.Module] | None"]

_HEAD_COUNTS = ("num_attention_heads", *HEAD_COUNT_ATTRIBUTES)


@dataclass(frozen=True)
class Interior:
    """One attention unit, by module names: ``projections`` (name, parts) ``C -> parts * width``, ``output``
    ``width -> C``, ``heads`` heads of ``width // heads``; ``scores`` the projection parts that feed the scores
    (doubling one does not double the output projection's input, as doubling a value part does)."""

    name: str
    projections: tuple[tuple[str, int], ...]
    output: str
    heads: int
    width: int
    scores: tuple[tuple[str, int], ...] = ()  # (projection, part) feeding the attention scores: q and k

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def head_count(module: nn.Module) -> int:
    """The module's head count attribute (0 when it has none)."""
    return next((v for a in _HEAD_COUNTS if type(v := getattr(module, a, None)) is int), 0)


def find_interiors(model: nn.Module, inputs: Any) -> list[Interior]:
    """The attention units of ``model`` whose heads lie as this module cuts them (see the module docstring)."""
    from torch import nn

    candidates = [m for m in model.modules() if head_count(m) >= 1
                  and sum(isinstance(c, nn.Linear) for c in m.children()) >= 3]
    if not candidates:
        return []
    following = _linear_after(model, inputs, candidates)
    names = {module: name for name, module in model.named_modules()}
    units = [u for m, r in capture_calls(model, inputs, candidates).items()
             if (u := _unit(m, r, following.get(m), names)) is not None]
    scopes = {_scope(unit): model.get_submodule(_scope(unit)) for unit in units}
    calls = capture_calls(model, inputs, list(scopes.values())) if units else {}
    found = []
    for unit in units:
        scope = scopes[_scope(unit)]
        call = calls.get(scope, {}).get("call")
        if call is not None and _layout_holds(scope, unit, call):
            found.append(dataclasses.replace(unit, scores=_score_parts(scope, unit, call)))
    return found


def _score_parts(scope: nn.Module, unit: Interior, call: tuple) -> tuple[tuple[str, int], ...]:
    """The (projection, part) pairs of ``unit`` whose doubling, in a copy of ``scope``, does not double the
    output projection's input: query and key parts (a value part's doubling goes straight through)."""
    import torch

    args, kwargs, _ = call
    local = _rebased(unit, _scope(unit))

    def output_input(module: nn.Module) -> torch.Tensor:
        seen = []
        hook = module.get_submodule(local.output).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        try:
            with torch.no_grad():
                module(*args, **kwargs)
        finally:
            hook.remove()
        return seen[0]

    baseline = output_input(scope)
    scores = []
    for (name, parts), (local_name, _) in zip(unit.projections, local.projections):
        for part in range(parts):
            trial = copy.deepcopy(scope)
            linear = trial.get_submodule(local_name)
            rows = slice(part * unit.width, (part + 1) * unit.width)
            with torch.no_grad():
                linear.weight[rows] *= 2
                if linear.bias is not None:
                    linear.bias[rows] *= 2
            if not torch.allclose(output_input(trial), 2 * baseline, atol=1e-5, rtol=1e-4):
                scores.append((name, part))
    return tuple(scores)


def _linear_after(model: nn.Module, inputs: Any, modules: list[nn.Module]) -> dict[nn.Module, nn.Module]:
    """For each of ``modules``, the first linear layer called after its first call returns."""
    import torch
    from torch import nn

    from optkit.kinds.base import call_with

    pending: list[nn.Module] = []
    seen: set[int] = set()
    found: dict[nn.Module, nn.Module] = {}

    def returned(module, args, output):
        if id(module) not in seen:
            seen.add(id(module))
            pending.append(module)

    def linear_called(linear, args):
        while pending:
            found[pending.pop()] = linear

    hooks = [m.register_forward_hook(returned) for m in modules]
    hooks += [m.register_forward_pre_hook(linear_called) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            call_with(model, inputs)
    except Exception:  # noqa: BLE001 - a model that does not run has no units found here
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    return found


def _unit(module: nn.Module, record: dict, after: nn.Module | None, names: dict) -> Interior | None:
    """The unit ``module`` heads: its child linears are the input projections, closed by its last child linear
    (the output projection inside it) or else by the first linear called after it (an output module beside it)."""
    from torch import nn

    linears = [c for c in record["children"] if isinstance(c, nn.Linear)]
    if "call" not in record or len(linears) < 3:
        return None
    for *ins, out in (linears, [*linears, after]) if after is not None else (linears,):
        width, heads = out.in_features, head_count(module)
        projections = tuple((names[lin], lin.out_features // width) for lin in ins
                            if lin.in_features == out.out_features and lin.out_features % width == 0)
        if width % heads == 0 and sum(parts for _, parts in projections) >= 3:
            return Interior(names[module], projections, names[out], heads, width)
    return None


def _scope(unit: Interior) -> str:
    """The innermost module holding the unit's head-count module and its output projection."""
    if unit.output.startswith(f"{unit.name}."):
        return unit.name
    common = []
    for mine, theirs in zip(unit.name.split("."), unit.output.split(".")):
        if mine != theirs:
            break
        common.append(mine)
    return ".".join(common)


def _layout_holds(scope: nn.Module, unit: Interior, call: tuple) -> bool:
    """Whether shuffling the heads, and each head's dims in its own order, everywhere in a copy of the unit's
    ``scope``, leaves its output of ``call`` unchanged (a shuffle the same for every head could also be one of
    dims and heads in another layout)."""
    import torch

    args, kwargs, output = call
    expected = _first_tensor(output)
    if expected is None:
        return False
    trial = copy.deepcopy(scope)
    generator = torch.Generator().manual_seed(0)
    heads = torch.randperm(unit.heads, generator=generator)
    dims = torch.stack([torch.randperm(unit.head_dim, generator=generator) for _ in range(unit.heads)])
    try:
        _select(trial, _rebased(unit, _scope(unit)), heads, dims, True)
        with torch.no_grad():
            actual = _first_tensor(trial(*args, **kwargs))
    except Exception:  # noqa: BLE001 - a unit that does not run permuted is not one
        return False
    return actual is not None and actual.shape == expected.shape and torch.allclose(actual, expected, atol=1e-5,
                                                                                      rtol=1e-4)


def _first_tensor(value: Any) -> torch.Tensor | None:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _rebased(unit: Interior, prefix: str) -> Interior:
    """``unit`` with its layer names relative to the module named ``prefix``."""
    def strip(name: str) -> str:
        return name if not prefix else "" if name == prefix else name[len(prefix) + 1:]
    return Interior(strip(unit.name), tuple((strip(name), parts) for name, parts in unit.projections),
                    strip(unit.output), unit.heads, unit.width)


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
        ``None`` when some unit's new width takes neither."""
        by_name = {unit.name: unit for unit in units}
        counts = {}
        for element, names in self.elements.items():
            widths = {built[0][f"{by_name[n].output}.weight"][1] for n in names}
            head_dims, heads = {by_name[n].head_dim for n in names}, {by_name[n].heads for n in names}
            if len(widths) != 1 or len(head_dims) != 1 or len(heads) != 1:
                return None
            (width,), (head_dim,), (old,) = widths, head_dims, heads
            if width % head_dim == 0 and width // head_dim <= old:
                counts[element] = width // head_dim
            elif width % old == 0:
                counts[element] = old
            else:
                return None
        return self._with(fields, counts)

    @staticmethod
    def _with(fields: dict[str, Any], counts: dict[tuple[str, int | None], int]) -> dict[str, Any]:
        edited = dict(fields)
        for (key, index), count in counts.items():
            edited[key] = count if index is None else _replaced(edited[key], index, count)
        return edited


def find_head_fields(units: list[Interior], fields: dict[str, Any], built: tuple[Shapes, Any, nn.Module],
                     build: Build) -> HeadFields:
    """The elements of ``fields`` (which ``built``) that set units' head counts, found by setting each int
    element equal to some unit's head count to 1: it is one when only those units' head counts change (to 1),
    and only their per-head parameters, with the same output shapes."""
    counts = {unit.heads for unit in units if unit.heads > 1}
    elements: dict[tuple[str, int | None], tuple[str, ...]] = {}
    for key, value in fields.items():
        listed = isinstance(value, list | tuple)
        for index, element in enumerate(value if listed else [value]):
            if type(element) is not int or element not in counts:
                continue
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
        _select(model, unit, kept, dims, heads != unit.heads)
        if factor != 1.0 and len(unit.scores) == 2:
            with torch.no_grad():
                for name, part in unit.scores:
                    linear = model.get_submodule(name)
                    rows = slice(part * width, (part + 1) * width)
                    linear.weight[rows] *= factor ** -0.5
                    if linear.bias is not None:
                        linear.bias[rows] *= factor ** -0.5


def _select(root: nn.Module, unit: Interior, heads: torch.Tensor, dims: torch.Tensor, per_head: bool) -> None:
    """Keep (in this order) heads ``heads`` and, in the i-th kept head, dims ``dims[i]`` of ``unit`` (names
    relative to ``root``); with ``per_head``, parameters under the unit's head-count module keep ``heads`` along
    their per-head axes (:func:`_head_axes`)."""
    import torch
    from torch import nn

    inner = (heads[:, None] * unit.head_dim + dims).flatten()
    for name, parts in unit.projections:
        linear = root.get_submodule(name)
        select_linear(linear, torch.cat([inner + part * unit.width for part in range(parts)]),
                      torch.arange(linear.in_features))
    output = root.get_submodule(unit.output)
    select_linear(output, torch.arange(output.out_features), inner)
    layers = {id(root.get_submodule(name)) for name, _ in unit.projections} | {id(output)}
    for owner in root.get_submodule(unit.name).modules() if per_head else ():
        if id(owner) in layers:
            continue
        for name, param in list(owner.named_parameters(recurse=False)):
            axes = _head_axes(owner, tuple(param.shape), unit.heads)
            if not axes:
                continue
            value = param.detach()
            for axis in axes:
                value = value.index_select(axis, heads.to(value.device))
            setattr(owner, name, nn.Parameter(value.clone(), requires_grad=param.requires_grad))


def _head_axes(owner: nn.Module, shape: tuple[int, ...], heads: int) -> list[int]:
    """The axes of a parameter of ``owner`` that run over the heads: a linear or conv layer's output axis when it
    has ``heads`` entries (one output per head), any axis of that length elsewhere (a bias table, a scale)."""
    from torch import nn

    if isinstance(owner, nn.Linear | nn.modules.conv._ConvNd):
        return [0] if shape and shape[0] == heads else []
    return [axis for axis, length in enumerate(shape) if length == heads]
