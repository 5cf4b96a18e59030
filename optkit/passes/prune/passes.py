"""Pruning passes: L1 unstructured (zeroes weights) and structured (removes channels).

Unstructured pruning shrinks nothing on dense kernels: the zeros cost the same
time. Structured pruning physically removes channels with torch-pruning's
dependency graph, so the model gets smaller and faster. Architectures that
torch-pruning does not follow on its own (attention heads, bare parameters,
window attention, channel shuffle) get help from :mod:`optkit.passes.prune.graph.arch`,
and the groups it still breaks on are found and held by
:mod:`optkit.passes.prune.graph.fallback`. What a structured prune aims at (a ratio,
a MACs, parameter or latency fraction, a sensitivity allocation) is a typed
target from :mod:`optkit.passes.prune.targets.configs`, reached by its registered
handler through :func:`optkit.passes.prune.graph.channels.prune_to`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult, Stage
from optkit.core.errors import OptkitError
from optkit.core.registry import register_pass
from optkit.core.settings import calib_data_setting, setting, shared_setting
from optkit.passes.prune.targets.budget import bind_budget, check_budget_run, check_latency_target

if TYPE_CHECKING:
    from torch import nn

    from optkit.core.context import RunContext
    from optkit.passes.prune.spec import PruneSpec
    from optkit.passes.prune.targets.curves import Sensitivity

STRUCTURED_IMPORTANCE = ("auto", "l1", "l2", "taylor", "bn_scale", "random", "activation")
ALLOCATIONS = ("auto", "uniform", "global", "sensitivity")
BLOCK_INPUTS = ("pruned", "unpruned")
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_ROUND_TO = 16
#: Calibration batches ``calibration_batches="auto"`` reads, and what it reads for a transformer given text and cut
#: to at most :data:`DEEP_CUT` of its parameters or MACs. At half the parameters, 16 batches instead of 4 gave
#: 1.31x instead of 1.41x validation perplexity on the shipped model and 3.17x instead of 3.35x on a model trained
#: on other text (8 batches: 1.33x and 3.32x); at 0.6 the gain was 0.2 %, at 0.8 none
#: (benchmarks/results/llm-defaults-shipped.md, llm-defaults-stdlib.md).
CALIBRATION_BATCHES, DEEP_CUT_BATCHES = 4, 16
DEEP_CUT = 0.55
#: A fraction target achieved at or above this removed nothing worth the name.
NOTHING_REMOVED = 0.999
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

        from optkit.model.stats import prunable_weights, weight_sparsity

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
    breaks on are held at full width (see :mod:`optkit.passes.prune.graph.fallback`). The model is put in eval mode while it is traced
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
    importance: str = setting("auto", help="How channels are ranked: l1, l2, taylor (gradient x weight; needs "
                              "data), bn_scale, random (a baseline), activation (a transformer's heads and MLP "
                              "channels by weight x input activation norm on calibration text; needs data), or auto "
                              "(activation for a transformer given text data, where it measured best in "
                              "benchmarks/results/llm-defaults-shipped.md; l1 otherwise).",
                              choices=STRUCTURED_IMPORTANCE, flag="importance")
    allocation: str = setting("auto", help="How the reduction is spread over layers: uniform (every group "
                              "loses the same fraction), global (channels ranked across all groups), "
                              "sensitivity (per-group ratios from measured accuracy curves, least predicted "
                              "loss for target_macs; needs data; see optkit sensitivity; for a transformer, the "
                              "split of target_params or target_macs between heads and MLP channels with the "
                              "least validation perplexity on text data), or auto (sensitivity for a transformer "
                              "given text data and a parameter or MACs target, where it measured best in "
                              "benchmarks/results/llm.md; uniform otherwise).",
                              choices=ALLOCATIONS, flag="allocation")
    iterative_steps: int = setting(1, help="Reach the ratio in this many equal steps (with a --prune ratio and a "
                                   "fine-tune on the command line, fine-tune after each; a target search prunes in "
                                   "steps and fine-tunes once at the end).", low=1, flag="iterative-steps")
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
    target_latency: float | str | None = setting(None, help="Prune until the ONNX Runtime latency, measured on "
                                                 "this machine, is this fraction of the original (instead of ratio). "
                                                 "With --deploy it is a budget met in any deployment: a fraction of "
                                                 "the unpruned ONNX Runtime FP32 latency, milliseconds per call at "
                                                 "--deploy-batch (3ms) or a language model's decode tokens/s "
                                                 "(40tok/s); each candidate is pruned just enough to meet it and the "
                                                 "most accurate on --calib-data is kept (docs/techniques/deployment.md).",
                                                 check=check_latency_target, flag="target-latency", enables=True,
                                                 replaces=("ratio",), metavar="FRACTION|Nms|Ntok/s")
    deployment: Any = setting(None, help="The deploy step a latency budget is met in (filled in from the run's "
                              "steps).", recipe=False, compare=False, repr=False)
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
                                          "importance, sensitivity allocation, and a latency target's choice among "
                                          "the copies that reach it (the most accurate on its val split).")
    bias_correction: bool = setting(True, help="Give back what removed channels contributed, so the model works "
                                    "better straight after pruning: for channels that come out of a BatchNorm, their "
                                    "expected contribution (from its weight and bias, no data needed); in a "
                                    "transformer given calibration text, a least-squares refit of the layers that "
                                    "read removed heads or MLP channels.")
    block_inputs: str = setting("unpruned", help="A transformer pruned block by block: each block's statistics and "
                                "refit are taken on the outputs of the blocks before it as they were (unpruned) or "
                                "as pruned (pruned). unpruned runs each block once instead of twice; pruned "
                                "measured within 0.1% of it on the shipped model and 0.1-3.6% lower on a model "
                                "trained on other text (benchmarks/results/llm-defaults-shipped.md, "
                                "llm-defaults-stdlib.md).",
                                choices=BLOCK_INPUTS, flag="block-inputs")
    calibration_batches: int | str = setting("auto", help="How many batches of data taylor importance, activation "
                                             "importance and a transformer's refit use; auto: 4, or 16 for a "
                                             "transformer given text and cut to at most 0.55 of its parameters or "
                                             "MACs (at half the parameters: 1.31x instead of 1.41x validation "
                                             "perplexity on the shipped model, for four times the block sweep's "
                                             "time; benchmarks/results/llm-defaults-shipped.md).", low=1,
                                             also=("auto",))
    batch_size: int = setting(16, help="Batch size when reading data.", low=1)
    calibration: Any = setting(None, help="Python only: (inputs, targets) batches for taylor importance.",
                               recipe=False, compare=False, repr=False)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")
    device: str | None = shared_setting("device", help="Where a transformer's blocks are pruned, one at a time, "
                                        "while the model stays where it was loaded (auto: CUDA, then MPS, then CPU).")

    def check(self) -> None:
        if self.target_macs is not None and self.target_params is not None:
            raise ValueError("give target_macs or target_params, not both")
        if self.target_latency is not None and (self.target_macs is not None or self.target_params is not None):
            raise ValueError("give target_latency or target_macs/target_params, not both")
        if self.round_to == "auto" and self.target_latency is None:
            raise ValueError("round_to 'auto' is chosen by the latency table: it needs target_latency")
        if self.allocation == "sensitivity" and (self.target_macs is None and self.target_params is None
                                                 or self.data is None):
            raise ValueError("allocation 'sensitivity' needs target_macs (the MACs fraction to reach; a transformer "
                             "also takes target_params) and data (a dataset spec whose val split scores each choice)")
        if self.importance in ("taylor", "activation") and self.data is None and self.calibration is None:
            raise ValueError(f"importance {self.importance!r} needs data: set data (a dataset spec) or calibration "
                             "(batches)")

    def check_run(self, steps: Sequence[Any]) -> None:
        """A latency target refuses the runs it cannot be met in (see
        :func:`optkit.passes.prune.targets.budget.check_budget_run`)."""
        if self.target_latency is not None:
            check_budget_run(self.target_latency, steps)

    def bind(self, context: RunContext) -> StructuredPrune:
        """With a latency target in a run with ``deploy``, the deploy step it is met in."""
        bound = super().bind(context)
        if self.target_latency is None or self.deployment is not None:
            return bound
        deployment = bind_budget(context)
        return bound if deployment is None else dataclasses.replace(bound, deployment=deployment)

    def apply(self, model: nn.Module) -> PassResult:
        if self.deployment is not None:
            return self.deployment.meet_budget(self, model)
        # Importing the handlers' modules registers them with the targets they reach.
        from optkit.passes.prune.targets import latency as latency_target  # noqa: F401
        from optkit.passes.prune.targets import mix as mix_target
        from optkit.passes.prune.targets import sensitivity as sensitivity_target
        from optkit.passes.prune.targets import ratio as target
        from optkit.passes.prune.targets.configs import reach

        result = reach(self.target(model), self.spec(model), model)
        _refuse_if_nothing_removed(result.details)
        _lead_with_a_miss(result.details)
        return result

    def target(self, model: nn.Module, sensitivity: Sensitivity | None = None) -> Any:
        """The target these settings ask for, as a typed config from :mod:`optkit.passes.prune.targets.configs`.

        The one place the target settings are read: ``target_latency``, else sensitivity
        allocation, else ``target_macs`` or ``target_params``, else ``ratio``.

        Args:
            model: the model (sensitivity allocation measures its curves on it).
            sensitivity: curves already measured for ``model``, used instead of measuring.

        Returns:
            a :class:`~optkit.passes.prune.targets.configs.RatioTarget`, ``MacsTarget``, ``ParamsTarget``,
            ``LatencyTarget`` or ``SensitivityTarget``.
        """
        from optkit.passes.prune.hf import describes_transformer
        from optkit.passes.prune.targets import configs as targets

        if isinstance(self.target_latency, str):
            raise OptkitError(f"target_latency {self.target_latency} is a budget met in a deployment: run it in a "
                              "pipeline with deploy, or give a fraction of the original's latency (0.5)")
        if self.target_latency is not None:
            round_to = None if self.round_to == "auto" else self.round_to
            return targets.LatencyTarget(self.target_latency, self.target_tolerance, self.latency_threads,
                                         self.latency_batch, round_to, self.data)
        if self.resolved_allocation(model) == "sensitivity" and self.submodule is None and describes_transformer(model):
            measured, fraction = ("macs", self.target_macs) if self.target_macs is not None else ("params",
                                                                                                self.target_params)
            return targets.MixTarget(fraction, self.target_tolerance, 8 if self.round_to == "auto" else self.round_to,
                                     measured, measured_by_default=self.allocation == "auto")
        if self.allocation == "sensitivity":
            if self.target_macs is None:
                raise ValueError("allocation 'sensitivity' of channels needs target_macs (the MACs fraction to reach)")
            if sensitivity is None:
                from optkit.passes.prune.targets.curves import SensitivitySettings, analyze

                sensitivity = analyze(model, SensitivitySettings(data=self.data), self)
            return targets.SensitivityTarget(self.target_macs, self.target_tolerance, self.round_to, sensitivity)
        if self.target_macs is not None:
            return targets.MacsTarget(self.target_macs, self.target_tolerance, self.round_to)
        if self.target_params is not None:
            return targets.ParamsTarget(self.target_params, self.target_tolerance, self.round_to)
        return targets.RatioTarget(self.ratio, self.round_to)

    def resolved_allocation(self, model: nn.Module) -> str:
        """The allocation this run uses: ``auto`` is ``sensitivity`` for a transformer given text data and a
        parameter or MACs target (the measured best for language models), else ``uniform``."""
        if self.allocation != "auto":
            return self.allocation
        targeted = self.target_macs is not None or self.target_params is not None
        return "sensitivity" if targeted and self.target_latency is None and self._transformer_text(model) else "uniform"

    def resolved_importance(self, model: nn.Module | None) -> str:
        """The importance this run uses: ``auto`` is ``activation`` for a transformer given text data (the measured
        best for language models), else ``l1``; ``l1`` too when no model is given."""
        if self.importance != "auto":
            return self.importance
        return "activation" if self._transformer_text(model) else "l1"

    def resolved_calibration_batches(self, model: nn.Module | None) -> int:
        """The calibration batches this run reads: ``auto`` is :data:`DEEP_CUT_BATCHES` for a transformer given text
        and cut to at most :data:`DEEP_CUT` of its parameters or MACs (a deep cut's refit and split search gain
        from more text; a light cut's do not), else :data:`CALIBRATION_BATCHES`."""
        if self.calibration_batches != "auto":
            return self.calibration_batches
        kept = self.target_params if self.target_params is not None else self.target_macs
        if kept is None and self.target_latency is None:
            kept = 1 - self.ratio
        deep = kept is not None and kept <= DEEP_CUT
        return DEEP_CUT_BATCHES if deep and self._transformer_text(model) else CALIBRATION_BATCHES

    def _transformer_text(self, model: nn.Module | None) -> bool:
        """Whether this run prunes a whole transformer (not a sub-module of it) given text data: what the ``auto``
        settings measured best for language models apply to."""
        from optkit.data.specs import is_text
        from optkit.passes.prune.hf import describes_transformer

        text = self.data is not None and is_text(self.data)
        return text and model is not None and self.submodule is None and describes_transformer(model)

    def spec(self, model: nn.Module | None = None) -> PruneSpec:
        """How these settings choose and remove channels, whatever the target (see :class:`PruneSpec`), for
        ``model`` (which settles ``importance`` and ``calibration_batches`` ``"auto"``)."""
        from optkit.passes.prune.spec import PruneSpec

        return PruneSpec(
            input_shape=tuple(self.input_shape or DEFAULT_INPUT_SHAPE), importance=self.resolved_importance(model),
            global_=self.allocation == "global", steps=self.iterative_steps, layer_ratios=self.layer_ratios,
            ignored_layers=self.ignored_layers, submodule=self.submodule, bias_correction=self.bias_correction,
            drop_blocks=self.drop_blocks, timeout_s=self.timeout_s, group_timeout_s=self.group_timeout_s,
            fallback_budget_s=self.fallback_budget_s, fallback_trials=self.fallback_trials, data=self.data,
            calibration=self.calibration, calibration_batches=self.resolved_calibration_batches(model),
            batch_size=self.batch_size,
            device=self.device, block_inputs=self.block_inputs)

    def prune(self, model: nn.Module, ratio: float) -> dict[str, Any]:
        """Prune ``model`` in place at ``ratio`` with this pass's other settings, ignoring its targets.

        Returns:
            the details of :func:`optkit.passes.prune.graph.channels.prune_to`.

        Raises:
            ValueError: for a layer pattern or sub-module that matches nothing.
        """
        from optkit.passes.prune.graph.channels import prune_to

        spec = self.spec(model)
        return prune_to(model, spec, spec.uniform(ratio, self.round_to))

    def _root_and_inputs(self, model: nn.Module) -> tuple[nn.Module, Any, str | None]:
        # groups.prunable_groups calls this on the pass sensitivity.analyze gives it.
        return self.spec().root_and_inputs(model)

    @classmethod
    def split_for_training(cls, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """This pass's recipe entry as the prunes to run with a training pass after each.

        With ``iterative_steps = K`` and a ratio, K entries that each remove the same
        fraction of what is left, compounding to the ratio; otherwise the entry itself.

        Args:
            entry: a ``[[pass]]`` entry of this pass.

        Returns:
            the entries to run in its place, in order.
        """
        count = entry.get("iterative_steps", 1)
        if count <= 1 or "ratio" not in entry:
            return [entry]
        step = {k: v for k, v in entry.items() if k != "iterative_steps"}
        step["ratio"] = 1.0 - (1.0 - entry["ratio"]) ** (1.0 / count)
        return [dict(step) for _ in range(count)]


def _refuse_if_nothing_removed(details: dict[str, Any]) -> None:
    """A fraction target that removed nothing is an error naming why (a run asked to shrink a model must not
    succeed with the model unchanged)."""
    asked, achieved = details.get("target_fraction"), details.get("achieved_fraction")
    if asked is None or achieved is None or achieved < NOTHING_REMOVED or asked >= NOTHING_REMOVED:
        return
    why = "; ".join(str(note).removeprefix("structured_prune ") for note in details.get("notes", ())[:2])
    raise OptkitError(f"structured_prune removed nothing: asked {details.get('target', 'size')} {asked:g} of the "
                      f"original, achieved {achieved:.3f}" + (f" ({why})" if why else ""))


def _lead_with_a_miss(details: dict[str, Any]) -> None:
    """Put the note on a target missed by more than the report's tolerance first, so the report leads with it."""
    from optkit.passes.prune.targets.ratio import REPORT_TOLERANCE

    asked, achieved = details.get("target_fraction"), details.get("achieved_fraction")
    if asked is None or achieved is None or abs(achieved - asked) <= REPORT_TOLERANCE:
        return
    notes = details.setdefault("notes", [])
    missed = [note for note in notes if "achieved" in str(note) and f"{asked:g}" in str(note)]
    if not missed:
        missed = [f"structured_prune: asked {details.get('target', 'size')} {asked:g} of the original, achieved "
                  f"{achieved:.3f}"]
    notes[:] = missed[:1] + [note for note in notes if note not in missed[:1]]


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
    from optkit.passes.prune.graph import channels

    settings = StructuredPrune(input_shape=tuple(input_shape), ignored_layers=tuple(ignored_layers), round_to=round_to)
    spec = settings.spec()
    return channels.skipped_layers(model, spec, spec.uniform(settings.ratio, round_to))
