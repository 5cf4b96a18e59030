"""Channel widths a Hugging Face model's own config describes, for models the transformer engine does not take.

A ``transformers`` model whose widths vary by stage (a Swin's ``embed_dim``
doubling per stage, a ``mlp_ratio``, a list of ``hidden_sizes``) has no single
hidden size or head count for :mod:`optkit.passes.prune.hf`; a free
channel prune of it runs but leaves widths its config cannot state, so the
stock class cannot reload it. Here the config itself is asked which of its
numbers are widths: each numeric field (or list of them) is scaled by the
kept share and the stock class built from the edited config on the meta
device; a field is a width when that changes only the channel counts of
conv/linear layers and one-dimensional parameters (norms, biases), nothing
else (an embedding's rows, a kernel size, a position table, a parameter's
name), and the rebuilt model still takes the same inputs and gives outputs of
the same shapes (so ``num_channels`` and ``num_labels`` are not widths). All
such fields scaled together give every group's kept channel count, the prune
keeps exactly those, and the result is accepted only when every parameter
has the shape the edited config builds.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.passes.prune.hf import config_heads
from optkit.passes.prune.hf.head_units import Interior, find_interiors

if TYPE_CHECKING:
    from torch import nn

Shapes = dict[str, tuple[int, ...]]
#: Seconds the search for width fields may take (each field edit builds the stock class on the meta device and
#: runs it); on reaching it, the widths found by then are kept and a note says so.
SEARCH_BUDGET_S = 120.0
#: The name progress lines are shown under.
STAGE = "structured_prune"


@dataclass(frozen=True)
class DescribedWidths:
    """A config edit and the per-group ratios that prune a model to the widths it describes.

    Also the attention units (:mod:`.config_heads`), what the edit makes of each (unit name -> (heads, inner
    width, score factor)), and their input projections (``held``, names relative to the pruned root), which the
    channel prune leaves to the units.
    """

    edits: dict[str, Any]
    per_group: dict[str, float]
    before: dict[str, Any]
    interiors: tuple[Interior, ...] = ()
    heads: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    held: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        return ", ".join(f"{key} {self.before[key]}->{value}" for key, value in self.edits.items())


def describe(model: nn.Module, spec: Any, widths: Any, notes: list[str] | None = None) -> DescribedWidths | None:
    """The config edit that keeps about ``1 - widths.ratio`` of every width field, with the group ratios it implies.

    ``spec`` and ``widths`` are :mod:`optkit.passes.prune.graph.channels`' ``PruneSpec`` and ``Widths`` (one ratio
    for every group), which call this module.

    ``None`` when the model is not a ``transformers`` model, its config does not rebuild it as it is (or the
    rebuilt model does not run on the meta device), or no field of its config is such a width.

    The search shows progress and stops at :data:`SEARCH_BUDGET_S` seconds, keeping the widths found by then;
    a line saying so goes to ``notes`` (when given) and to the result's ``notes``.
    """
    from optkit.core.progress import progress
    from optkit.kinds import example_inputs, is_hf_pretrained
    from optkit.passes.prune.graph.groups import prunable_groups, ratios_for

    if not is_hf_pretrained(model) or widths.ratio <= 0:
        return None
    deadline = time.monotonic() + SEARCH_BUDGET_S
    base = model.config.to_dict()
    inputs = example_inputs(model, spec.input_shape)
    current = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    built = _stock_build(model, base, inputs)
    if built is None or built[1] is None or built[0] != current:
        return None
    layers = dict(model.named_modules())
    build = lambda fields: _stock_build(model, fields, inputs)  # noqa: E731
    interiors = find_interiors(model, inputs, stage=STAGE)
    heads = config_heads.find_head_fields(interiors, base, built, build, stage=STAGE, deadline=deadline)
    # Width edits are tried with one head per unit (any width splits into one head), heads chosen after.
    reference = build(heads.pinned(base)) if heads.elements else built
    if reference is None or reference[1] is None:
        heads, reference = config_heads.HeadFields({}), built
    head_keys = {key for key, _ in heads.elements}

    def width_edit(fields: dict[str, Any]) -> tuple[Shapes, Any, nn.Module] | None:
        """The model ``fields`` build (one head per unit), when it differs from the reference only in channel
        widths."""
        edited = build(heads.pinned(fields))
        ok = edited is not None and edited[1] == reference[1] and _only_channels(reference[0], edited[0], layers)
        return edited if ok else None

    edits: dict[str, Any] = {}
    # Fields that, edited alone, add or remove layers (a shortcut projection between two widths that were equal), or
    # build a model that does not run (EfficientNet's width_coefficient without the top width, hidden_dim): tried
    # in pairs afterwards (a ResNet's stem and stage widths).
    restructuring: dict[str, Any] = {}
    shown, tried = progress(STAGE, "config fields tried as widths", len(base)), 0
    for key, value in base.items():
        if time.monotonic() > deadline:
            break
        tried += 1
        shown.step(detail=key)
        for candidate in _scaled(value, 1.0 - widths.ratio, widths.round_to) if key not in head_keys else ():
            edited = build(heads.pinned({**base, key: candidate}))
            if edited is not None and edited[1] is None:
                restructuring.setdefault(key, candidate)
            if edited is None or edited[1] != reference[1]:
                continue
            if _only_channels(reference[0], edited[0], layers):
                edits[key] = candidate
                break
            if edited[0].keys() != reference[0].keys():
                restructuring.setdefault(key, candidate)
    pairs = list(itertools.combinations(restructuring, 2))
    shown, paired = progress(STAGE, "pairs of config fields tried", len(pairs)), 0
    for first, second in pairs:
        if time.monotonic() > deadline:
            break
        paired += 1
        shown.step()
        pair = {first: restructuring[first], second: restructuring[second]}
        if first not in edits and second not in edits and width_edit({**base, **edits, **pair}) is not None:
            edits.update(pair)
    stopped = ()
    if tried < len(base) or paired < len(pairs):
        stopped = (f"structured_prune stopped the search for width fields of the config at its {SEARCH_BUDGET_S:g} "
                   f"s budget (config_widths.SEARCH_BUDGET_S), after {tried} of {len(base)} fields and {paired} of "
                   f"{len(pairs)} pairs; the widths found by then are kept",)
        if notes is not None:
            notes += stopped
    narrowed = width_edit({**base, **edits}) if edits else None
    fields = heads.split({**base, **edits}, interiors, narrowed) if narrowed is not None else None
    built = build(fields) if fields is not None else None
    if built is None or not config_heads.heads_differ_only(interiors, narrowed, built):
        return None
    edits = {key: value for key, value in fields.items() if value != base[key]}
    target = built[0]
    _, _, submodule = spec.root_and_inputs(model)
    prefix = f"{submodule}." if submodule else ""
    try:
        groups = prunable_groups(spec, model)
    except Exception:  # noqa: BLE001 - torch-pruning cannot group it; the free prune's fallback search takes over
        return None
    held = tuple(name[len(prefix):] for unit in interiors for name, _ in unit.projections)
    kept = [g.channels if g.pattern in held else target.get(f"{prefix}{g.pattern}.weight", (g.channels,))[0]
            for g in groups]
    if any(k > g.channels for g, k in zip(groups, kept)):
        return None
    return DescribedWidths(edits, ratios_for(groups, kept), {key: base[key] for key in edits}, tuple(interiors),
                           config_heads.targets(interiors, built, model), held, stopped)


def adopt_config(model: nn.Module, described: DescribedWidths) -> str | None:
    """Write the edit into ``model.config`` if the pruned model has exactly the shapes it describes.

    Returns:
        ``None`` when it does (the config object is updated in place, so modules holding it see the edit);
        otherwise one line saying which parameter differs, and the config is left as it was.
    """
    from optkit.passes.prune.hf.transformer import matches_stock

    config = model.config
    edited = type(config).from_dict({**config.to_dict(), **described.edits})
    saved = dict(vars(config))
    vars(config).update(vars(edited))
    problem = matches_stock(model)
    if problem is not None:
        vars(config).clear()
        vars(config).update(saved)
    return problem


def _scaled(value: Any, keep: float, round_to: int) -> list[Any]:
    """Smaller values of a config field to try, best first: a multiple of ``round_to`` near ``keep * value``, then
    the nearest integer, then multiples of ``2 * round_to``, ``4 * round_to``, ... (a width that must divide into
    groups of 64, say); for a float, ``keep * value``; for a list of positive ints or floats, each element so."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [options[0] for options in _int_options([value], keep, round_to)] if value > 1 else []
    if isinstance(value, float):
        return [round(value * keep, 4)] if value > 0 and math.isfinite(value) else []
    if isinstance(value, list | tuple) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                          and v > 1 for v in value):
        return [type(value)(options) for options in _int_options(list(value), keep, round_to)]
    if isinstance(value, list | tuple) and value and all(type(v) is float and v > 0 and math.isfinite(v)
                                                          for v in value):
        return [type(value)(round(v * keep, 4) for v in value)]  # a ratio per stage (CvT's mlp_ratio)
    return []


def _int_options(values: list[int], keep: float, round_to: int) -> list[list[int]]:
    """Candidate edits of ``values`` (all elements at one rounding), best first; each element in [1, value)."""
    exact = [v * keep for v in values]
    steps = [round_to, 1]
    while steps[-1] * 2 <= max(values) // 2:
        steps.append(max(steps[-1], round_to) * 2)
    options = []
    for step in steps:
        for rule in (round, math.floor) if step == 1 else (round,):
            option = [rule(e / step) * step for e in exact]
            if all(1 <= o < v for o, v in zip(option, values)) and option not in options:
                options.append(option)
    return options


def _stock_build(model: nn.Module, fields: dict[str, Any], inputs: Any) -> tuple[Shapes, Any, nn.Module] | None:
    """The parameter shapes of the model's stock class built on the meta device from ``fields``, the shapes of
    its outputs on ``inputs`` (moved to the meta device), and the built model; ``None`` if the class refuses the
    config, and ``None`` for the outputs if the call fails (an edited input width, for one)."""
    import torch
    from torch.utils._pytree import tree_map

    from optkit.io.hf import stock_class

    meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    try:
        config = type(model.config).from_dict(dict(fields))
        with torch.device("meta"):
            fresh = stock_class(model)(config).eval()
    except Exception:  # noqa: BLE001 - a config the class refuses is not a candidate
        return None
    shapes = {n: tuple(p.shape) for n, p in fresh.named_parameters(remove_duplicate=False)}
    try:
        with torch.device("meta"), torch.no_grad():
            out = fresh(*tree_map(meta, inputs.args), **tree_map(meta, inputs.kwargs))
    except Exception:  # noqa: BLE001 - a model that does not run has no outputs to compare
        return shapes, None, fresh
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    return shapes, tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v, out), fresh


def _only_channels(current: Shapes, edited: Shapes, layers: dict[str, nn.Module]) -> bool:
    """Whether ``edited`` differs from ``current`` somewhere, and only by narrower channels: the first two
    dimensions of conv/linear weights (never a kernel's), one-dimensional parameters (biases, norms, scales) of
    any module but an embedding, and other parameters (a ConvNeXt-V2 response norm's ``1x1x1xC``) only along
    axes that narrow exactly as some conv/linear channel count does."""
    from torch import nn

    from optkit.model.stats import PRUNABLE_WEIGHT_TYPES

    if edited.keys() != current.keys():
        return False
    changed = [n for n in current if edited[n] != current[n]]
    if not changed:
        return False
    channel_pairs = set()
    others = []
    for name in changed:
        layer, old, new = layers.get(name.rpartition(".")[0]), current[name], edited[name]
        if len(old) != len(new) or any(n > o for n, o in zip(new, old)):
            return False
        if isinstance(layer, PRUNABLE_WEIGHT_TYPES):
            if old[2:] != new[2:]:
                return False
            channel_pairs.update((o, n) for o, n in zip(old[:2], new[:2]) if o != n)
        elif isinstance(layer, nn.Embedding):
            return False
        elif len(old) > 1:
            others.append((old, new))
    return all((o, n) in channel_pairs for old, new in others for o, n in zip(old, new) if o != n)
