"""Sensitivity analysis: what pruning each dependency group alone costs, measured on data.

For every group a structured prune would shrink (largest MACs first), a copy of
the model has only that group pruned at each of a few ratios (with the
prune's own channel rounding, checks and fallback), its BatchNorm statistics
recalibrated on training images, and is scored on a bounded subset of the
dataset's ``val`` split (held out of training, never the ``test`` split other
reports use): top-1 accuracy, top-1 agreement with the original and mean KL
divergence from its softmax, both as pruned (BatchNorm statistics as they
were) and after the recalibration. Recalibrated losses are counted from the
unpruned model recalibrated the same way, so a curve shows what pruning costs
and not what recalibration alone changes (large on a model whose statistics do
not fit the data, such as a random-init one). The curves say where channels
are cheap; sensitivity allocation (``StructuredPrune(allocation="sensitivity")``)
uses them to reach a MACs target with the least predicted loss.

The allocation's loss serves both states a pruned model is used in: as it
comes out of the prune and recalibrated (which a fine-tune starts from). Each
state's loss is divided by its total over all measured points, so neither
scale drowns the other: the recalibrated loss by :attr:`SensitivitySettings.metric`,
the as-pruned loss as top-1 disagreement with the original. Disagreement is
bounded where as-pruned KL is not (one group pruned alone can reach a KL of 4
on a trained CNN), and additive per-group KL then overrates the groups whose
stale statistics hurt most in isolation.

Each point is cached on disk as soon as it is measured, keyed by the model's
weights and architecture, the data and every setting that changes a point, so
a rerun is instant and a run stopped by its time budget resumes where it
stopped.

Importing this module needs no torch (the CLI reads :class:`SensitivitySettings`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass
from optkit.core.settings import Settings, setting

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.prune.graph.groups import Group

#: Part of the cache key: bumped when what a point measures changes.
SCORING_VERSION = 5
METRICS = ("kl", "accuracy")
#: With ``metric="accuracy"``, KL breaks ties between groups whose accuracy did not move (noise on a small subset).
KL_TIE_BREAK = 1e-3
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SensitivitySettings(Settings):
    """How the per-group curves are measured."""

    data: str = setting(help="Dataset spec: its val split scores each pruned copy, its train split recalibrates "
                        "BatchNorm.", flag="data", metavar="SPEC", dataset=True, example="synthetic:64:3x32x32:10")
    samples: int = setting(512, help="Score each copy on the first this many val images.", low=1, flag="samples")
    ratios: tuple[float, ...] = setting((0.25, 0.5, 0.75), help="Fractions of a group's channels removed, one "
                                        "measurement each (comma-separated).", low=0, high=1, low_open=True,
                                        high_open=True, flag="ratios")
    metric: str = setting("kl", help="What allocation minimizes: kl (mean KL divergence from the unpruned "
                          "model's softmax; needs no labels, least noisy) or accuracy (top-1 drop on the subset).",
                          choices=METRICS, flag="metric")
    as_pruned_weight: float = setting(1.0, help="Weight of the as-pruned loss (top-1 disagreement before "
                                      "BatchNorm recalibration) against the recalibrated one, each scaled by its "
                                      "total over the measured points; 0 allocates for the recalibrated model only.",
                                      low=0, flag="as-pruned-weight")
    calibration_samples: int = setting(256, help="Training images that recalibrate BatchNorm statistics after "
                                       "each prune (0 disables).", low=0, flag="calibration-samples")
    batch_size: int = setting(128, help="Images per forward pass.", low=1, flag="eval-batch-size")
    time_budget_s: float = setting(300.0, help="Stop measuring after this many seconds; groups left unmeasured "
                                   "are not pruned by the allocation (0: no limit).", low=0, flag="time-budget")

    def check(self) -> None:
        """Rules that involve several values: the ratios are distinct.

        Raises:
            ValueError: naming the repeated ratios.
        """
        if len(set(self.ratios)) != len(self.ratios):
            raise ValueError(f"ratios must be distinct; got {self.ratios}")


@dataclass
class Point:
    """One group pruned alone at one ratio.

    Attributes:
        ratio: the ratio asked; kept: the channels the group kept.
        macs_fraction: the copy's MACs over the original's.
        accuracy, agreement, mean_kl: scores on the subset after BatchNorm recalibration (agreement
            and KL against the original).
        as_pruned_accuracy, as_pruned_agreement, as_pruned_mean_kl: the same, before recalibration.
    """

    ratio: float
    kept: int
    macs_fraction: float
    accuracy: float
    agreement: float
    mean_kl: float
    as_pruned_accuracy: float
    as_pruned_agreement: float
    as_pruned_mean_kl: float


@dataclass
class Curve:
    """A group's measurements (``points`` in ratio order; empty when the time budget ran out first)."""

    pattern: str
    channels: int
    macs_share: float
    points: list[Point] = field(default_factory=list)


@dataclass
class Sensitivity:
    """The analysis of one model.

    Attributes:
        curves: one per group, largest MACs share first.
        groups: the groups themselves (same order), for allocation.
        baseline: the scores of the unpruned model with BatchNorm recalibrated like every pruned copy
            (agreement and KL against the original): each curve's zero point.
        macs: the original's MACs.
        metric: the recalibrated state's loss in :meth:`loss`.
        cost: ``seconds``, ``measured`` (points measured now), ``cached`` (points read from the cache).
        unmeasured: group patterns the time budget left without any point.
        as_pruned_weight: weight of the as-pruned loss in :meth:`loss` (0: the recalibrated loss alone,
            in the metric's own units).
        score_model: scores a whole pruned model (a copy is recalibrated) on the same subset as the
            points, as a :class:`Point` with ``ratio`` 0; ``None`` for an analysis made by hand.
    """

    curves: list[Curve]
    groups: list[Group]
    baseline: dict[str, float]
    macs: int
    metric: str
    cost: dict[str, float]
    unmeasured: list[str]
    settings: dict[str, Any]
    as_pruned_weight: float = 0.0
    score_model: Callable[[nn.Module], Point] | None = field(default=None, repr=False, compare=False)

    def loss(self, point: Point) -> float:
        """The point's predicted loss: recalibrated and, weighted, as pruned, each scaled by its total.

        With ``as_pruned_weight`` 0 it is :meth:`recalibrated_loss` itself.
        """
        recalibrated = self.recalibrated_loss(point)
        if not self.as_pruned_weight:
            return recalibrated
        recalibrated_total, as_pruned_total = self._totals
        return recalibrated / recalibrated_total + self.as_pruned_weight * (1 - point.as_pruned_agreement) / as_pruned_total

    def losses_among(self, points: list[Point]) -> list[float]:
        """Each point's loss as in :meth:`loss`, but with the totals taken over ``points`` alone.

        For comparing whole pruned models (candidate allocations) with each other.
        """
        recalibrated = [self.recalibrated_loss(p) for p in points]
        if not self.as_pruned_weight:
            return recalibrated
        as_pruned = [1 - p.as_pruned_agreement for p in points]
        recalibrated_total, as_pruned_total = sum(recalibrated) or 1.0, sum(as_pruned) or 1.0
        return [r / recalibrated_total + self.as_pruned_weight * a / as_pruned_total
                for r, a in zip(recalibrated, as_pruned)]

    def recalibrated_loss(self, point: Point) -> float:
        """The point's loss by :attr:`metric`, measured from :attr:`baseline` (the unpruned model recalibrated)."""
        kl = max(0.0, point.mean_kl - self.baseline["mean_kl"])
        if self.metric == "kl":
            return kl
        return max(0.0, self.baseline["accuracy"] - point.accuracy) + KL_TIE_BREAK * kl

    def loss_description(self) -> str:
        """What :meth:`loss` measures, in words (for reports and plot axes)."""
        recalibrated = "mean KL from the original" if self.metric == "kl" else "accuracy drop (+ KL tie-break)"
        if not self.as_pruned_weight:
            return recalibrated
        return (f"{recalibrated} after recalibration + {self.as_pruned_weight:g} x top-1 disagreement as pruned, "
                "each over its total")

    @property
    def _totals(self) -> tuple[float, float]:
        points = [p for c in self.curves for p in c.points]
        recalibrated = sum(self.recalibrated_loss(p) for p in points)
        as_pruned = sum(1 - p.as_pruned_agreement for p in points)
        return recalibrated or 1.0, as_pruned or 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: settings, baseline, cost and every curve's points."""
        return {"settings": self.settings, "metric": self.metric, "baseline": self.baseline, "macs": self.macs,
                "cost": self.cost, "unmeasured": self.unmeasured,
                "curves": [{"pattern": c.pattern, "channels": c.channels, "macs_share": round(c.macs_share, 4),
                            "points": [dataclasses.asdict(p) for p in c.points]} for c in self.curves]}


def analyze(model: nn.Module, settings: SensitivitySettings, prune: Pass, *,
            progress: bool = False) -> Sensitivity:
    """Measure how each prunable group's pruning alone changes the model's outputs.

    Args:
        model: the model (not changed; copies are pruned).
        settings: data, subset, ratios, metric and time budget.
        prune: the :class:`~optkit.passes.prune.passes.StructuredPrune` whose groups, rounding and
            importance are analyzed (its ``input_shape`` is the model's input; ``ratio`` and targets
            are ignored). Typed as a ``Pass``: that pass calls this module through its sensitivity target.
        progress: show a progress bar (on a terminal; one log line per group otherwise).

    Returns:
        the curves, with the cost (seconds, points measured now and read from the cache).

    Raises:
        DataError: for a missing dataset, or data whose classes or image shape the model does not take.
    """
    from optkit.analysis.evaluation import EvalSettings, load_eval_set, torch_logits
    from optkit.model.stats import count_macs
    from optkit.passes.prune.graph.groups import prunable_groups
    from optkit.passes.prune.targets.latency_table import layer_specs
    from optkit.passes.prune.targets.scoring import SCORE_SPLIT, calibration_images

    start = time.perf_counter()
    shape = tuple(prune.input_shape or DEFAULT_INPUT_SHAPE)
    template = dataclasses.replace(prune, input_shape=shape, ratio=0.0, target_macs=None, target_params=None, target_latency=None,
                                   allocation="uniform", layer_ratios=None, iterative_steps=1,
                                   importance=prune.resolved_importance(model))
    eval_set = load_eval_set(EvalSettings(settings.data, samples=settings.samples, batch_size=settings.batch_size),
                             model, shape, split=SCORE_SPLIT)
    calibration = calibration_images(settings.data, shape, settings.calibration_samples, settings.batch_size)
    reference = torch_logits(model, eval_set, settings.batch_size)
    macs = count_macs(model, shape)
    groups = prunable_groups(template, model)
    specs = layer_specs(model, shape)
    shares = [sum(specs[n]["macs"] for n in dict.fromkeys(g.outs + g.ins) if n in specs) / macs for g in groups]
    order = sorted(range(len(groups)), key=lambda i: -shares[i])
    groups = [groups[i] for i in order]
    curves = [Curve(g.pattern, g.channels, shares[i]) for g, i in zip(groups, order)]
    key = _cache_key(model, settings, template, shape)
    cache = _read_cache(key)
    baseline = _scores(torch_logits(_recalibrated(model, calibration), eval_set, settings.batch_size), eval_set,
                       reference)
    counts = {"measured": 0, "cached": 0}
    ratios = sorted(settings.ratios)
    out_of_time = False
    with _Progress(progress, len(groups) * len(ratios)) as bar:
        for curve in curves:
            for ratio in ratios:
                slot = f"{curve.pattern}@{ratio:g}"
                if slot in cache:
                    counts["cached"] += 1
                elif settings.time_budget_s and time.perf_counter() - start > settings.time_budget_s:
                    out_of_time = True
                    break
                else:
                    cache[slot] = _measure(model, template, curve, ratio, eval_set, calibration, reference, macs,
                                           settings.batch_size)
                    counts["measured"] += 1
                    _write_cache(key, cache)
                curve.points.append(Point(**cache[slot]))
                bar.advance(curve.pattern)
            if out_of_time:
                break
    unmeasured = [c.pattern for c in curves if not c.points]
    if out_of_time:
        _log.warning("sensitivity: time budget of %gs reached; %d group(s) unmeasured and kept whole "
                     "(rerun to continue from the cache)", settings.time_budget_s, len(unmeasured))
    cost = {"seconds": round(time.perf_counter() - start, 2), **counts}
    summary = {**dataclasses.asdict(settings), "input_shape": list(shape), "round_to": template.round_to,
               "importance": template.importance}

    def score_model(pruned: nn.Module) -> Point:
        import copy

        from optkit.model.stats import count_macs

        candidate = copy.deepcopy(pruned)
        scores = _scored(candidate, eval_set, calibration, reference, settings.batch_size)
        return Point(ratio=0.0, kept=0, macs_fraction=round(count_macs(candidate, shape) / macs, 6), **scores)

    return Sensitivity(curves, groups, baseline, macs, settings.metric, cost, unmeasured, summary,
                       settings.as_pruned_weight, score_model)


def _measure(model: nn.Module, template: Pass, curve: Curve, ratio: float, eval_set, calibration,
             reference, macs: int, batch_size: int) -> dict[str, Any]:
    import copy

    from optkit.model.stats import count_macs

    candidate = copy.deepcopy(model)
    dataclasses.replace(template, layer_ratios={curve.pattern: ratio}).prune(candidate, 0.0)
    scores = _scored(candidate, eval_set, calibration, reference, batch_size)
    root = candidate.get_submodule(template.submodule) if template.submodule else candidate
    layer = root.get_submodule(curve.pattern)
    kept = getattr(layer, "out_channels", getattr(layer, "out_features", curve.channels))
    return {"ratio": ratio, "kept": int(kept), "macs_fraction": round(count_macs(candidate, template.input_shape) / macs, 6),
            **scores}


def _scored(candidate: nn.Module, eval_set, calibration, reference, batch_size: int) -> dict[str, float]:
    """Scores of ``candidate`` as it is, then recalibrated (in place): the fields of a :class:`Point` that score."""
    from optkit.analysis.evaluation import torch_logits
    from optkit.passes.batchnorm.passes import recalibrate_batchnorm

    as_pruned = _scores(torch_logits(candidate, eval_set, batch_size), eval_set, reference)
    if calibration:
        recalibrate_batchnorm(candidate, calibration)
    scores = _scores(torch_logits(candidate, eval_set, batch_size), eval_set, reference) if calibration else as_pruned
    return {**scores, **{f"as_pruned_{key}": value for key, value in as_pruned.items()}}


def _recalibrated(model: nn.Module, calibration: list) -> nn.Module:
    """A copy of the original with BatchNorm recalibrated like the pruned copies (the model itself without data)."""
    import copy

    from optkit.passes.batchnorm.passes import recalibrate_batchnorm

    if not calibration:
        return model
    reference = copy.deepcopy(model)
    recalibrate_batchnorm(reference, calibration)
    return reference


def _scores(logits, eval_set, reference) -> dict[str, float]:
    from optkit.analysis.evaluation import score

    s = score(logits, eval_set, reference)
    return {"accuracy": s["accuracy"], "agreement": s["agreement"], "mean_kl": round(s["mean_kl"], 8)}


def _cache_key(model: nn.Module, settings: SensitivitySettings, template: Pass,
               shape: tuple[int, ...]) -> str:
    import hashlib

    import torch_pruning

    from optkit import __version__
    from optkit.model.stats import fingerprint

    described = {"method": SCORING_VERSION, "model": fingerprint(model), "data": settings.data, "samples": settings.samples,
                 "calibration_samples": settings.calibration_samples, "shape": list(shape),
                 "prune": {k: repr(getattr(template, k)) for k in ("round_to", "importance", "ignored_layers",
                                                                    "submodule", "data", "calibration_batches",
                                                                    "bias_correction")},
                 "optkit": __version__, "torch_pruning": torch_pruning.__version__}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def _cache_path(key: str):
    from optkit.core.files import cache_dir

    return cache_dir() / "sensitivity" / f"{key}.json"


def _read_cache(key: str) -> dict[str, Any]:
    path = _cache_path(key)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, cache: dict[str, Any]) -> None:
    from optkit.core.files import write_text

    write_text(_cache_path(key), json.dumps(cache, sort_keys=True))


class _Progress:
    """A rich progress bar over the points on a terminal; a log line per finished group elsewhere."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar, self.done = enabled, total, None, 0

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = Progress(TextColumn("sensitivity {task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=console, transient=True)
                self.task = self.bar.add_task("", total=self.total)
                self.bar.start()
        return self

    def advance(self, pattern: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=pattern)
        elif self.enabled:
            _log.info("sensitivity: %d/%d points (%s)", self.done, self.total, pattern)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
