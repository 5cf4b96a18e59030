"""Attention units found by structure: the head-count module, its q/k/v projections and output projection.

Used by :mod:`.config_heads` to cut attention whose width is its stage's width (a Swin's).

* A unit is a module with a head count attribute whose child linears are
  called, in one traced forward pass, as input projections ``C -> k * W``
  (``k`` parts: separate q, k, v, or fused), closed by an output projection
  ``W -> C``: its last child linear, or else the first linear called after it
  returns (an output module beside it, as in BERT-style code). Never by name.
* Its layout (``heads`` blocks of ``W / heads`` channels in every
  projection, per-head parameters with an axis ``heads`` long) is checked by
  trying it: shuffling the heads, and the dims inside each head in an order
  of its own, everywhere at once, must leave the output as it was (a shuffle
  the same for every head could also be one of dims and heads in another
  layout).
* Its score parts (q and k) are those whose doubling does not double the
  output projection's input, as doubling a value part does.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.graph.attention import HEAD_COUNT_ATTRIBUTES, capture_calls
from optkit.passes.prune.graph.opaque import select_linear

if TYPE_CHECKING:
    import torch
    from torch import nn

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


def find_interiors(model: nn.Module, inputs: Any, *, stage: str = "structured_prune") -> list[Interior]:
    """The attention units of ``model`` whose heads lie as this module cuts them (see the module docstring);
    each unit's check is shown as progress under ``stage``."""
    from torch import nn

    from optkit.core.progress import progress

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
    shown = progress(stage, "attention units checked", len(units))
    for unit in units:
        shown.step(detail=unit.name)
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
        select_heads(trial, _rebased(unit, _scope(unit)), heads, dims, True)
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


def select_heads(root: nn.Module, unit: Interior, heads: torch.Tensor, dims: torch.Tensor, per_head: bool) -> None:
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
