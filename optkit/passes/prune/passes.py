"""Pruning passes: L1 unstructured (zeroes weights) and structured (removes channels).

Unstructured pruning shrinks nothing on dense kernels: the zeros cost the same
time. Structured pruning physically removes channels with torch-pruning's
dependency graph, so the model gets smaller and faster. Architectures that
torch-pruning does not follow on its own (attention heads, bare parameters,
window attention, channel shuffle) get help from :mod:`optkit.passes.prune.arch`,
and the groups it still breaks on are found and held by
:mod:`optkit.passes.prune.fallback`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult, Stage
from optkit.core.registry import register_pass
from optkit.core.settings import calib_data_setting, setting, shared_setting

if TYPE_CHECKING:
    from torch import nn

STRUCTURED_IMPORTANCE = ("l1", "l2", "taylor", "bn_scale", "random")
ALLOCATIONS = ("uniform", "global", "sensitivity")
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_ROUND_TO = 16
PRUNE_RATIO_HELP = "Fraction to prune, in [0, 1): channels (structured) or weights (unstructured)."
GLOBAL_HELP = "Rank across all layers instead of per layer."
UNSTRUCTURED_NOTE = (
    "Unstructured pruning zeroes weights but keeps every tensor dense: dense kernels "
    "(PyTorch, ONNX Runtime) run no faster and the file is no smaller uncompressed. "
    "Use structured pruning for speed; zeros only shrink a compressed file."
)


@register_pass
@dataclass(frozen=True)
class L1Unstructured(Pass):
    """Zero the smallest-magnitude conv/linear weights (L1), made permanent.

    The pruning reparametrization (``weight_orig``, ``weight_mask``, forward
    pre-hooks) is removed afterwards, so the model is an ordinary module.
    The report's ``sparsity`` is measured exactly after pruning. Works in place.
    """

    name = "l1_unstructured"
    stage = Stage.PRUNE
    variant = ("method", "unstructured")
    ratio: float = setting(0.3, help=PRUNE_RATIO_HELP, low=0, high=1, high_open=True, flag="prune", enables=True)
    global_: bool = setting(False, help=GLOBAL_HELP, flag="global")

    def apply(self, model: nn.Module) -> PassResult:
        from torch.nn.utils import prune

        from optkit.analysis.metrics import prunable_weights, weight_sparsity

        targets = [(module, "weight") for _, module in prunable_weights(model)]
        if not targets:
            return PassResult(model, {"pruned_layers": 0, "sparsity": 0.0})
        if self.global_:
            prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=self.ratio)
        else:
            for module, param in targets:
                prune.l1_unstructured(module, param, amount=self.ratio)
        for module, param in targets:
            prune.remove(module, param)
        return PassResult(model, {"pruned_layers": len(targets), "sparsity": weight_sparsity(model),
                                  "notes": [UNSTRUCTURED_NOTE]})


@register_pass
@dataclass(frozen=True)
class StructuredPrune(Pass):
    """Remove whole channels with torch-pruning's dependency graph (group L1 by default).

    A deep copy is pruned and checked, then its state is moved into the
    model passed in (so the pass works in place), except with a target, where
    the returned model is the pruned copy that met it. Groups torch-pruning
    breaks on are held at full width (see :mod:`optkit.passes.prune.fallback`). The model is put in eval mode while it is traced
    and restored after. ``calibration`` (Python only) takes an iterable of
    ``(inputs, targets)`` batches for ``taylor`` importance instead of ``data``.
    """

    name = "structured_prune"
    stage = Stage.PRUNE
    variant = ("method", "structured")
    variant_default = True
    ratio: float = setting(0.3, help=PRUNE_RATIO_HELP + " Ignored when target_macs, target_params or "
                           "target_latency is set.",
                           low=0, high=1, high_open=True, flag="prune", enables=True)
    round_to: int | str = setting(DEFAULT_ROUND_TO, help="Keep channel counts multiples of this (aligned counts "
                                  "run faster: 16 fp32 values fill one AVX-512 register, the channel block of ONNX "
                                  "Runtime's CPU convolutions); 1 disables rounding; auto (with target_latency) "
                                  "picks 4, 8, 16 or 32 by the latency table.", low=1, also=("auto",),
                                  flag="round-to", metavar="auto|N")
    importance: str = setting("l1", help="How channels are ranked: l1, l2, taylor (gradient x weight; needs data), "
                              "bn_scale, or random (a baseline).", choices=STRUCTURED_IMPORTANCE, flag="importance")
    allocation: str = setting("uniform", help="How the reduction is spread over layers: uniform (every group "
                              "loses the same fraction), global (channels ranked across all groups), or "
                              "sensitivity (per-group ratios from measured accuracy curves, least predicted "
                              "loss for target_macs; needs data; see optkit sensitivity).",
                              choices=ALLOCATIONS, flag="allocation")
    iterative_steps: int = setting(1, help="Reach the ratio in this many equal steps (with a fine-tune on the "
                                   "command line, fine-tune after each).", low=1, flag="iterative-steps")
    ignored_layers: tuple[str, ...] = setting((), help="fnmatch patterns of module names whose output channels are "
                                              "kept; the layers that feed the model's outputs always keep theirs.")
    layer_ratios: dict[str, float] | None = setting(None, help="Per-layer ratio overrides, keyed by fnmatch pattern.",
                                                    low=0, high=1, high_open=True)
    target_macs: float | None = setting(None, help="Prune until MACs are this fraction of the original, e.g. 0.5 "
                                        "(instead of ratio).", low=0, high=1, low_open=True, high_open=True,
                                        flag="target-macs", enables=True, replaces=("ratio",))
    target_params: float | None = setting(None, help="Prune until parameters are this fraction of the original "
                                          "(instead of ratio).", low=0, high=1, low_open=True, high_open=True,
                                          flag="target-params", enables=True, replaces=("ratio",))
    target_latency: float | None = setting(None, help="Prune until the ONNX Runtime latency, measured on this "
                                           "machine, is this fraction of the original (instead of ratio).",
                                           low=0, high=1, low_open=True, high_open=True, flag="target-latency",
                                           enables=True, replaces=("ratio",))
    latency_threads: int | None = setting(None, help="Intra-op threads the latency target is measured at "
                                          "(default: all cores).", low=1, flag="threads")
    latency_batch: int = setting(1, help="Batch size the latency target is measured at.", low=1, flag="batch")
    target_tolerance: float = setting(0.01, help="Stop the target search once the achieved fraction is this close.",
                                      low=0, high=0.5, high_open=True)
    timeout_s: float = setting(DEFAULT_TIMEOUT_S, help="Time limit in seconds for one try at tracing, pruning and "
                               "checking the model (enforced on the main thread only; 0 disables).", low=0)
    group_timeout_s: float = setting(5.0, help="Time limit in seconds for torch-pruning to build one dependency "
                                     "group; a group that takes longer is held at full width (0 disables).", low=0)
    fallback_budget_s: float = setting(40.0, help="Seconds the first try and the fallback search, which finds the "
                                       "groups that break the pruned model, may take; groups left untested are held.",
                                       low=0)
    fallback_trials: int = setting(40, help="How many trial prunes the fallback search may make.", low=1)
    drop_blocks: int = setting(0, help="Transformers (a Hugging Face model with repeated blocks): also remove this "
                               "many whole blocks, those whose output is most like their input.", low=0,
                               flag="drop-blocks")
    submodule: str | None = setting(None, help="Prune only this sub-module (e.g. backbone), keeping the widths of "
                                    "its outputs; detection and segmentation models default to their backbone.")
    data: str | None = calib_data_setting(help="Dataset spec (fashion-mnist, imagefolder:DIR, ...) for taylor "
                                          "importance and sensitivity allocation.")
    bias_correction: bool = setting(True, help="Give back the expected contribution of removed channels that come "
                                    "out of a BatchNorm (estimated from its weight and bias, no data needed) to the "
                                    "layers that read them, so the model works better straight after pruning.")
    calibration_batches: int = setting(4, help="How many batches taylor importance uses.", low=1)
    batch_size: int = setting(16, help="Batch size when reading data.", low=1)
    calibration: Any = setting(None, help="Python only: (inputs, targets) batches for taylor importance.",
                               recipe=False, compare=False, repr=False)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def check(self) -> None:
        if self.target_macs is not None and self.target_params is not None:
            raise ValueError("give target_macs or target_params, not both")
        if self.target_latency is not None and (self.target_macs is not None or self.target_params is not None):
            raise ValueError("give target_latency or target_macs/target_params, not both")
        if self.round_to == "auto" and self.target_latency is None:
            raise ValueError("round_to 'auto' is chosen by the latency table: it needs target_latency")
        if self.allocation == "sensitivity" and (self.target_macs is None or self.data is None):
            raise ValueError("allocation 'sensitivity' needs target_macs (the MACs fraction to reach) and data "
                             "(a dataset spec whose val split scores each group)")
        if self.importance == "taylor" and self.data is None and self.calibration is None:
            raise ValueError("importance 'taylor' needs data: set data (a dataset spec) or calibration (batches)")

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.passes.prune import latency_target as _latency_target
        from optkit.passes.prune import sensitivity_target as _sensitivity_target
        from optkit.passes.prune import target as _prune_target

        if self.target_latency is not None:
            return _latency_target.search(self, model)
        if self.allocation == "sensitivity":
            return _sensitivity_target.search(self, model)
        if self.target_macs is None and self.target_params is None:
            return PassResult(model, self.prune(model, self.ratio))
        return _prune_target.search(self, model)

    def prune(self, model: nn.Module, ratio: float) -> dict[str, Any]:
        """Prune ``model`` at ``ratio`` with this pass's other settings, never leaving it half-changed.

        A deep copy is pruned and checked (forward, backward, same output
        shapes); dependency groups that break it, raise or do not finish in
        ``group_timeout_s`` are found by the fallback search and held at full
        width. The checked copy's state is then moved into ``model``. When
        nothing can be pruned, ``model`` is left exactly as it was.

        Returns:
            details for the report: ``skipped_layers`` (name -> reason),
            ``pruned_layers`` (count), ``held_layers`` (group roots the
            fallback held -> the error they caused), ``fallback`` (its cost:
            ``trials``, ``seconds``), and ``shortfall`` (one line) when less
            than asked was reachable.

        Raises:
            ValueError: for a layer pattern or sub-module that matches nothing.
        """
        from optkit.analysis.metrics import count_macs
        from optkit.kinds import example_inputs
        from optkit.passes.prune import engine as _engine
        from optkit.passes.prune.transformer import describes_transformer

        if self.submodule is None and describes_transformer(model):
            return self._prune_transformer(model, ratio)
        if self.drop_blocks:
            raise ValueError("drop_blocks removes blocks of a Hugging Face transformer (a model with a config and "
                             "repeated blocks); this model is not one")
        from optkit.passes.prune import fallback as _fallback
        from optkit.passes.prune import limits as _limits

        shape = self.input_shape or DEFAULT_INPUT_SHAPE
        root, inputs, submodule = self._root_and_inputs(model)
        held, overrides = _engine.user_choices(root, self.ignored_layers, self.layer_ratios)
        held.update(_kind_held(model, root, held))
        names = {module: name for name, module in root.named_modules()}
        job = _fallback.Job(
            model=model, root_name=submodule or "", model_inputs=example_inputs(model, shape), root_inputs=inputs,
            options=_engine.Options(_importance(self.importance), ratio, self.allocation == "global",
                                    self.iterative_steps, self.round_to, self.bias_correction),
            held={names[m]: reason for m, reason in held.items()},
            overrides={names[m]: value for m, value in overrides.items()}, submodule=submodule,
            before_step=self._taylor_gradients() if self.importance == "taylor" else None,
            attempt_limit_s=self.timeout_s or None, group_limit_s=self.group_timeout_s or None,
            budget_s=self.fallback_budget_s, max_trials=self.fallback_trials)
        outcome = _fallback.prune_verified(job)
        details: dict[str, Any] = {"ratio": ratio}
        if outcome.model is None:
            details.update(pruned_layers=0, skipped_layers={n: outcome.error for n in _conv_linear_names(root)},
                           shortfall=f"nothing pruned: {outcome.error}; the model is unchanged. Hold the blocks "
                                     "named in the error with ignored_layers, or raise timeout_s")
        else:
            macs_before = count_macs(model, shape) if outcome.held else None
            _adopt(model, outcome.model)
            root = model.get_submodule(submodule) if submodule else model
            details.update(pruned_layers=sum(1 for n in _conv_linear_names(root) if n not in outcome.skipped),
                           skipped_layers=outcome.skipped)
            if outcome.held:
                achieved = count_macs(model, shape) / macs_before
                details["held_layers"] = outcome.held
                count = f"{len(outcome.held)} layer{'s' if len(outcome.held) > 1 else ''}"
                details["shortfall"] = (f"asked {ratio:g} per group, achieved MACs {achieved:.2f}; "
                                        f"{count} held, see held_layers")
        details["fallback"] = {"trials": outcome.trials, "seconds": outcome.seconds}
        if "shortfall" in details:
            details["notes"] = [f"structured_prune {details['shortfall']} (fallback search: {outcome.trials} "
                                f"trial prune(s), {outcome.seconds:.1f} s)"]
        if submodule:
            details["submodule"] = submodule
        if self.timeout_s and not _limits.limit_available():
            details["time_limit"] = "not enforced (SIGALRM needs the main thread)"
        return details

    def _prune_transformer(self, model: nn.Module, ratio: float) -> dict[str, Any]:
        """Whole heads (KV groups kept whole), MLP channels and blocks, uniform across blocks, config updated.

        The stock ``transformers`` class still describes the result, so it is
        saved with ``save_pretrained`` and reloads with ``from_pretrained``.
        """
        from optkit.kinds import example_inputs
        from optkit.passes.prune.transformer import prune_transformer

        unsupported = [name for name, value in (("ignored_layers", self.ignored_layers),
                                                ("layer_ratios", self.layer_ratios),
                                                ("allocation", self.allocation != "uniform"),
                                                ("importance", self.importance != "l1"),
                                                ("iterative_steps", self.iterative_steps != 1)) if value]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} apply to channel pruning with torch-pruning; a transformer's "
                             "heads, MLP channels and blocks are pruned uniformly by weight norm: leave them at "
                             "their defaults (or set submodule to prune a part of it channel by channel)")
        inputs = example_inputs(model, self.input_shape or DEFAULT_INPUT_SHAPE)
        keywords = dict(inputs.kwargs) or {getattr(model, "main_input_name", "input"): inputs.first()}
        keywords.pop("use_cache", None)
        round_to = self.round_to if isinstance(self.round_to, int) else 8
        result = prune_transformer(model, heads_ratio=ratio, mlp_ratio=ratio, drop_blocks=self.drop_blocks,
                                   example_inputs=keywords, round_to=round_to)
        before, after = result["before"], result["after"]
        notes = [f"structured_prune {line}" for line in result["skipped"]]
        if before["heads"] and after["heads"] != before["heads"]:
            removed = 1 - after["heads"] / before["heads"]
            if abs(removed - ratio) > 0.05:
                notes.append(f"structured_prune removed {before['heads'] - after['heads']} of {before['heads']} "
                             f"attention heads ({removed:.2f}, asked {ratio:g}): heads go in whole key/value groups "
                             f"({before['kv_heads']} here), so the share was rounded")
        return {"ratio": ratio, "transformer": result, "pruned_layers": after["attention_units"],
                "skipped_layers": {}, "notes": notes}

    def _root_and_inputs(self, model: nn.Module) -> tuple[nn.Module, Any, str | None]:
        import torch

        from optkit.analysis.metrics import eval_mode
        from optkit.kinds import call_with, example_inputs, kind_of

        inputs = example_inputs(model, self.input_shape or DEFAULT_INPUT_SHAPE)
        submodule = self.submodule if self.submodule is not None else kind_of(model).prune_root(model)
        if not submodule:
            return model, inputs, None
        try:
            root = model.get_submodule(submodule)
        except AttributeError as e:
            raise ValueError(f"submodule {submodule!r} is not a module of {type(model).__name__}") from e
        captured: list = []
        hook = root.register_forward_pre_hook(lambda module, args: captured.append(args))
        try:
            with eval_mode(model), torch.no_grad():
                call_with(model, inputs)
        finally:
            hook.remove()
        if not captured:
            raise ValueError(f"submodule {submodule!r} does not run in a forward pass at input_shape {self.input_shape}")
        args = captured[0]
        return root, args[0] if len(args) == 1 else list(args), submodule

    def _taylor_gradients(self):
        batches = self.calibration if self.calibration is not None else _data_batches(self)

        def accumulate(model: nn.Module) -> None:
            import torch
            import torch.nn.functional as F

            from optkit.analysis.metrics import model_device

            device = model_device(model)
            model.zero_grad(set_to_none=True)
            seen = 0
            with torch.enable_grad():
                for batch in batches:
                    if seen >= self.calibration_batches:
                        break
                    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                        raise ValueError("taylor importance needs (inputs, targets) batches")
                    inputs, targets = batch[0].to(device), batch[1].to(device)
                    F.cross_entropy(model(inputs), targets).backward()
                    seen += 1
            if not seen:
                raise ValueError("taylor importance got no calibration batches")

        return accumulate


def _kind_held(model: nn.Module, root: nn.Module, held: dict[Any, str]) -> dict[Any, str]:
    """The layers of ``root`` that the model's kind keeps at full width (see :meth:`ModelKind.held_layers`)."""
    from optkit.kinds import kind_of

    inside = set(root.modules())
    modules = dict(model.named_modules())
    return {modules[name]: reason for name, reason in kind_of(model).held_layers(model).items()
            if modules[name] in inside and modules[name] not in held}


def _adopt(model: nn.Module, pruned: nn.Module) -> None:
    # The caller keeps its model object; it takes the pruned copy's modules and attributes.
    model.__dict__.clear()
    model.__dict__.update(pruned.__dict__)


def skipped_layers(model: nn.Module, input_shape: Iterable[int] = DEFAULT_INPUT_SHAPE, *,
                   ignored_layers: Iterable[str] = (), round_to: int = DEFAULT_ROUND_TO) -> dict[str, str]:
    """Conv/linear layers a structured prune would leave untouched, with the reason for each.

    A dry run: the model is traced but not changed (its train/eval mode is restored).

    Args:
        model: the model.
        input_shape: example input shape used to trace it.
        ignored_layers: fnmatch patterns the prune would be given.
        round_to: the channel rounding the prune would use.

    Returns:
        ``{layer name: reason}``; layer names are relative to the pruned
        sub-module (``backbone`` for detection/segmentation models).
    """
    from optkit.passes.prune import engine as _prune_structured

    settings = StructuredPrune(input_shape=tuple(input_shape), ignored_layers=tuple(ignored_layers), round_to=round_to)
    root, inputs, submodule = settings._root_and_inputs(model)
    held, _ = _prune_structured.user_choices(root, settings.ignored_layers, None)
    held.update(_kind_held(model, root, held))
    options = _prune_structured.Options(_importance("l1"), settings.ratio, False, 1, round_to)
    return _prune_structured.prune_tree(root, inputs, options, held, {}, submodule=submodule, dry_run=True)


def _conv_linear_names(root: nn.Module) -> list[str]:
    from optkit.analysis.metrics import prunable_weights

    return [name for name, _ in prunable_weights(root)]


def _data_batches(settings: StructuredPrune):
    from optkit.data import load_dataset, make_loader

    dataset = load_dataset(settings.data, "train", augment=False)
    return make_loader(dataset, settings.batch_size, shuffle=True, num_workers=0, seed=0)


def _importance(kind: str):
    import torch_pruning as tp

    if kind == "l1":
        return tp.importance.GroupMagnitudeImportance(p=1)
    if kind == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if kind == "taylor":
        return tp.importance.GroupTaylorImportance()
    if kind == "bn_scale":
        return tp.importance.BNScaleImportance()
    return tp.importance.RandomImportance()
