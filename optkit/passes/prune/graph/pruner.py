"""The structured pruning engine behind :class:`optkit.passes.prune.passes.StructuredPrune`.

It builds a torch-pruning ``BasePruner`` with the architecture support from
:mod:`optkit.passes.prune.graph.arch`, leaves the layers whose outputs are the
(sub)model's outputs at full width, prunes, and says which conv/linear
layers were left untouched and why.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.kinds.base import ModelInputs, call_with
from optkit.passes.prune.graph.arch import ArchSupport, arch_support, input_group, unprunable_grouped_convs
from optkit.passes.prune.graph.tp_fixes import converging_groups, root_types

if TYPE_CHECKING:
    from torch import nn

OUTPUT_REASON = "its outputs are the model's outputs (e.g. the classifier), so its width is kept"
SUBMODULE_OUTPUT_REASON = "its outputs leave the pruned sub-module '{}', so its width is kept"


@dataclass
class Plan:
    """A torch-pruning pruner ready to step, and why layers are held at full width.

    Attributes:
        pruner: the torch-pruning ``BasePruner``.
        root: the module being pruned (the model or one of its sub-modules).
        held: module -> reason it keeps its output width.
        support: the architecture support used.
    """

    pruner: Any
    root: Any
    held: dict[Any, str]
    support: ArchSupport


@dataclass(frozen=True)
class Options:
    """The pruning settings torch-pruning is given (see ``StructuredPrune`` for their meaning)."""

    importance: Any
    ratio: float
    global_: bool
    iterative_steps: int
    round_to: int
    bias_correction: bool = False


def matching(root: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Names of ``root``'s modules matching any fnmatch pattern.

    Raises:
        ValueError: naming the patterns that match no module.
    """
    patterns = tuple(patterns)
    names = [name for name, _ in root.named_modules() if name]
    matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"layer pattern(s) {', '.join(map(repr, unmatched))} match no module of the model")
    return matched


def user_choices(root: nn.Module, ignored_layers: Iterable[str],
                 layer_ratios: dict[str, float] | None) -> tuple[dict[Any, str], dict[Any, float]]:
    """Modules held by ``ignored_layers`` patterns (with the reason) and per-layer ratio overrides.

    Raises:
        ValueError: for a pattern that matches no module.
    """
    from optkit.model.stats import PRUNABLE_WEIGHT_TYPES

    modules = dict(root.named_modules())
    held: dict[Any, str] = {}
    for pattern in ignored_layers:
        for name in matching(root, (pattern,)):
            for sub in modules[name].modules():
                held.setdefault(sub, f"matches ignored_layers pattern {pattern!r}")
    overrides = {
        modules[name]: value
        for pattern, value in (layer_ratios or {}).items()
        for name in matching(root, (pattern,))
        if isinstance(modules[name], PRUNABLE_WEIGHT_TYPES)
    }
    return held, overrides


def build_plan(root: nn.Module, inputs: Any, options: Options, held: dict[Any, str],
               overrides: dict[Any, float], submodule: str | None = None) -> Plan:
    """Trace ``root`` and build its pruner (nothing is pruned yet).

    ``held`` and ``overrides`` may name modules outside ``root``; only its own count.
    """
    from torch import nn

    support = arch_support(root, inputs)
    held = _own_held(root, held, support)
    overrides = {m: value for m, value in overrides.items() if m in set(root.modules())}
    outputs: list = []
    was_training = root.training
    try:
        with warnings.catch_warnings(), support.tracing():
            warnings.simplefilter("ignore")
            pruner = _pruner_class()(
                root,
                _as_args(inputs),
                forward_fn=_forward_fn(inputs),
                importance=options.importance,
                global_pruning=options.global_,
                pruning_ratio=options.ratio,
                pruning_ratio_dict=overrides or None,
                iterative_steps=options.iterative_steps,
                ignored_layers=list(held),
                round_to=options.round_to if options.round_to > 1 else None,
                in_channel_groups={},
                out_channel_groups=dict(support.channel_groups),
                channel_groups={},
                num_heads=dict(support.num_heads),
                customized_pruners=support.customized_pruners or None,
                unwrapped_parameters=support.unwrapped_parameters or None,
                root_module_types=root_types(),
                output_transform=lambda out: _keep_outputs(out, outputs),
            )
    finally:
        root.train(was_training)
    _hold_outputs(pruner.DG, outputs, held, submodule)
    hold_unprunable_grouped_convs(pruner.DG, held)
    expanded = [m for h in held if isinstance(h, nn.Module) for m in h.modules()]
    # torch-pruning tests membership with ``in``: a parameter in this list would be compared elementwise.
    pruner.ignored_layers = [m for m in dict.fromkeys(pruner.ignored_layers + expanded) if isinstance(m, nn.Module)]
    return Plan(pruner, root, held, support)


def trace_graph(root: nn.Module, inputs: Any, held: dict[Any, str],
                submodule: str | None = None) -> tuple[Any, dict[Any, str]]:
    """Trace ``root``'s dependency graph alone: unlike :func:`build_plan`, no dependency group is built yet.

    Returns:
        the torch-pruning graph, and the modules kept at full width with the
        reason (those given, the architecture's and the output layers).
    """
    import torch_pruning as tp

    support = arch_support(root, inputs)
    held = _own_held(root, held, support)
    outputs: list = []
    was_training = root.training
    try:
        with warnings.catch_warnings(), support.tracing():
            warnings.simplefilter("ignore")
            root.eval()
            graph = tp.DependencyGraph().build_dependency(
                root, example_inputs=_as_args(inputs), forward_fn=_forward_fn(inputs),
                output_transform=lambda out: _keep_outputs(out, outputs),
                unwrapped_parameters=support.unwrapped_parameters or None,
                customized_pruners=support.customized_pruners or None, verbose=False)
    finally:
        root.train(was_training)
    _hold_outputs(graph, outputs, held, submodule)
    return graph, held


def _own_held(root: nn.Module, held: dict[Any, str], support: ArchSupport) -> dict[Any, str]:
    own = set(root.modules())
    held = {m: reason for m, reason in held.items() if m in own}
    modules = dict(root.named_modules())
    for name, reason in support.fixed.items():
        held.setdefault(modules[name], reason)
    return held


def _as_args(inputs: Any) -> Any:
    # A tuple is unpacked as the arguments; a bare tensor would first be
    # unpacked along its batch dimension and traced twice.
    if isinstance(inputs, ModelInputs):
        return inputs
    return tuple(inputs) if isinstance(inputs, list) else (inputs,)


def _forward_fn(inputs: Any) -> Callable[[Any, Any], Any] | None:
    # torch-pruning unpacks a tuple or dict itself; ModelInputs make the call they describe.
    return call_with if isinstance(inputs, ModelInputs) else None


def _hold_outputs(graph: Any, outputs: list, held: dict[Any, str], submodule: str | None) -> None:
    reason = SUBMODULE_OUTPUT_REASON.format(submodule) if submodule else OUTPUT_REASON
    for module in output_layers(graph, {t.grad_fn for t in outputs}):
        held.setdefault(module, reason)


def hold_unprunable_grouped_convs(graph: Any, held: dict[Any, str]) -> None:
    """Hold the grouped convs torch-pruning cannot prune, and the layers whose outputs feed them."""
    for conv, reason in unprunable_grouped_convs(graph).items():
        held.setdefault(conv, f"it is {reason}")
        name = graph._module2name.get(conv, type(conv).__name__)
        for dep, _ in input_group(graph, conv):
            if dep.target.module is not conv and graph.is_out_channel_pruning_fn(dep.handler):
                held.setdefault(dep.target.module, f"its outputs feed {name}, {reason}")


def run_plan(plan: Plan, before_step: Callable[[], None] | None = None, bias_correction: bool = False) -> set:
    """Prune in ``iterative_steps`` steps; returns the modules whose channels were pruned.

    With ``bias_correction`` the expected contribution of removed input
    channels is given back to the layers that lose them (see
    :mod:`optkit.passes.prune.graph.bias_correction`).
    """
    import torch

    from optkit.passes.prune.graph import bias_correction as compensation

    pruned: set = set()
    for _ in range(plan.pruner.iterative_steps):
        if before_step is not None:
            before_step()
        with torch.no_grad(), converging_groups():
            for group in plan.pruner.step(interactive=True):
                pruned.update(dep.target.module for dep, _ in group)
                if bias_correction:
                    for correction in compensation.corrections(plan.pruner.DG, group):
                        compensation.apply(plan.pruner.DG, correction)
                group.prune()
    plan.support.finish(plan.root)
    return pruned


def prune_tree(root: nn.Module, inputs: Any, options: Options, held: dict[Any, str], overrides: dict[Any, float],
               *, submodule: str | None = None, before_step: Callable[[], None] | None = None,
               dry_run: bool = False) -> dict[str, str]:
    """Prune ``root``, then each sub-module its architecture prunes on its own.

    Returns:
        the conv/linear layers of ``root`` left untouched, name -> reason.
    """
    plan = build_plan(root, inputs, options, held, overrides, submodule)
    plans = [plan]
    changed = prunable_modules(plan) if dry_run else run_plan(plan, before_step, options.bias_correction)
    if plan.support.subgraphs:
        sub_inputs = capture_inputs(root, inputs, plan.support.subgraphs)
        for name in plan.support.subgraphs:
            sub_plan = build_plan(root.get_submodule(name), sub_inputs[name], options, held, overrides,
                                  f"{submodule}.{name}" if submodule else name)
            plans.append(sub_plan)
            changed |= prunable_modules(sub_plan) if dry_run else run_plan(sub_plan, before_step, options.bias_correction)
    return skipped_report(root, plans, changed, options.round_to)


def capture_inputs(root: nn.Module, inputs: Any, names: list[str]) -> dict[str, Any]:
    """The input each named sub-module receives in one forward pass of ``root``.

    Raises:
        ValueError: if a named sub-module does not run.
    """
    import torch

    from optkit.model.state import eval_mode

    captured: dict[str, Any] = {}

    def keep(name):
        def hook(module, args):
            captured.setdefault(name, args[0] if len(args) == 1 else list(args))
        return hook

    hooks = [root.get_submodule(name).register_forward_pre_hook(keep(name)) for name in names]
    try:
        with eval_mode(root), torch.no_grad():
            call_with(root, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [n for n in names if n not in captured]
    if missing:
        raise ValueError(f"sub-module(s) {', '.join(missing)} did not run in a forward pass")
    return captured


def prunable_modules(plan: Plan) -> set:
    """Modules some prunable group would change (a dry run of :func:`run_plan`)."""
    pruner = plan.pruner
    found: set = set()
    with converging_groups():
        for group in pruner.DG.get_all_groups(ignored_layers=pruner.ignored_layers,
                                              root_module_types=pruner.root_module_types):
            found.update(dep.target.module for dep, _ in group)
    return found


def skipped_report(root: nn.Module, plans: list[Plan], changed: set, round_to: int) -> dict[str, str]:
    """Conv/linear layers of ``root`` left untouched, with the reason for each."""
    from optkit.model.stats import PRUNABLE_WEIGHT_TYPES

    covered = {sub for m in changed if hasattr(m, "modules") for sub in m.modules()}
    held = {m: reason for plan in plans for m, reason in plan.held.items()}
    inherited: dict[str, str] = {}
    report: dict[str, str] = {}
    for name, module in root.named_modules():
        parent = name.rpartition(".")[0]
        if module in held:
            inherited[name] = held[module]
        elif parent in inherited:
            inherited[name] = inherited[parent]
        if not isinstance(module, PRUNABLE_WEIGHT_TYPES) or module in covered:
            continue
        if name in inherited:
            report[name] = inherited[name]
            continue
        plan = next((p for p in reversed(plans) if module in p.pruner.DG.module2node), None)
        report[name] = "not reached by the traced forward pass" if plan is None else _tied_reason(plan, module, round_to)
    return report


def _tied_reason(plan: Plan, module: nn.Module, round_to: int) -> str:
    from optkit.passes.prune.graph.tp_fixes import GroupDoesNotConverge

    graph = plan.pruner.DG
    pruner_fn = graph.get_pruner_of_module(module)
    try:
        with converging_groups():
            group = graph.get_pruning_group(module, pruner_fn.prune_out_channels,
                                            list(range(pruner_fn.get_out_channels(module))))
    except GroupDoesNotConverge as error:
        return f"torch-pruning cannot build its dependency group ({error})"
    for dep, _ in group:
        target = dep.target.module
        if target is not module and target in plan.held and graph.is_out_channel_pruning_fn(dep.handler):
            name = graph._module2name.get(target, type(target).__name__)
            return f"its channels are tied (residual, concat or grouping) to {name}, which keeps its width"
    if _asked_ratio(plan, {dep.target.module for dep, _ in group}) == 0:
        return "no ratio was asked for it (the ratio is 0 and layer_ratios names none of its layers)"
    return f"no channels left to remove after rounding to multiples of round_to={round_to} (too few, or split across groups)"


def _asked_ratio(plan: Plan, members: set) -> float:
    """The last step's ratio the pruner was asked for a dependency group (its own override, else the default)."""
    pruner = plan.pruner
    for key, ratios in pruner.pruning_ratio_dict.items():
        if (set(key) if isinstance(key, tuple) else {key}) & members:
            return ratios[-1]
    return pruner.per_step_pruning_ratio[-1]


def _keep_outputs(out: Any, kept: list) -> Any:
    import torch
    import torch_pruning as tp

    kept.extend(t for t in tp.utils.flatten_as_list(out) if isinstance(t, torch.Tensor))
    return out


def output_layers(graph: Any, output_grad_fns: set) -> list:
    """Conv/linear (or attention) modules whose outputs reach a model output through channel-preserving ops.

    Args:
        graph: the torch-pruning dependency graph.
        output_grad_fns: ``grad_fn`` of each output tensor of the traced forward
            (an output may also feed later layers, e.g. a backbone's feature maps).
    """
    import torch_pruning as tp
    from torch import nn

    stops = (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention)
    found, seen = [], set()
    stack = [node for node in graph.module2node.values() if not node.outputs or node.grad_fn in output_grad_fns]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node.module, nn.Parameter):
            continue  # a bare parameter (class token) is pruned along with its group, never held itself
        if isinstance(node.module, stops) or node.type == tp.ops.OPTYPE.CUSTOMIZED:
            found.append(node.module)
            continue
        stack.extend(node.inputs)
    return found


def _pruner_class():
    import math

    import torch_pruning as tp

    class _Pruner(tp.pruner.BasePruner):
        """torch-pruning's ``BasePruner`` with channel rounding that respects channel groups.

        For a group of layers split into ``g`` channel groups (attention heads,
        grouped convolutions) torch-pruning ranks and counts the channels of one
        group but rounds that count as if it were the whole layer's, so each
        group loses a multiple of ``round_to`` channels: ViT-B's head size can
        only go 64 -> 56 -> 48, and a grouped conv with 4 channels per group
        is left unpruned (the rounded count exceeds a group). Here the
        per-group count is rounded so that the layer's total width is a
        multiple of ``round_to`` (each group keeps a multiple of
        ``round_to / gcd(round_to, g)``), and at least one step is kept.
        """

        def __init__(self, *args, **kwargs):
            self._groups_of_root: dict = {}
            self._counted: Any = None
            super().__init__(*args, **kwargs)
            for name in ("get_out_channels", "get_in_channels"):
                setattr(self.DG, name, self._remember_counted(getattr(self.DG, name)))

        def _remember_counted(self, count_channels):
            # The pruning loop counts a group root's channels right before rounding.
            def counted(module):
                self._counted = module
                return count_channels(module)
            return counted

        def _get_channel_groups(self, group) -> int:
            groups = super()._get_channel_groups(group)
            self._groups_of_root[group[0].dep.target.module] = groups
            return groups

        def _round_to(self, n_pruned, current_channels, round_to):
            groups = self._groups_of_root.get(self._counted, 1)
            if groups > 1 and current_channels % groups == 0:
                current_channels //= groups
                round_to //= math.gcd(round_to, groups)
            kept = current_channels - n_pruned
            kept = max(kept - kept % round_to, min(round_to, current_channels))
            return max(current_channels - kept, 0)

    return _Pruner
