"""A latency budget met in a deployment: the models and runtimes behind :func:`optkit.passes.deploy.search.search`.

:func:`meet_budget` is what ``structured_prune`` runs when its ``target_latency``
is met in the run's ``deploy`` step: it exports the model, builds, times and
scores each candidate (:class:`ImageDeployer`; a language model's,
:class:`optkit.passes.deploy.budget_tokens.TokenDeployer`), prunes copies with
the latency-target engine (the prune pass itself at a latency fraction, then
BatchNorm statistics re-estimated on the data; a language model at a parameter
fraction), and leaves
the chosen deployment and the frontier in the run's plan, where ``deploy``
finds them: it then builds only that deployment from the fine-tuned model,
times it again against the budget, and draws the frontier
(:func:`plot_frontier`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.contract import PassResult
from optkit.core.errors import DataError, OptkitError
from optkit.passes.deploy.candidate import Candidate
from optkit.passes.deploy.search import Pruned, score_figure, search
from optkit.passes.deploy.settings import CANDIDATES, TOKEN_CANDIDATES
from optkit.passes.prune.targets.budget import budget_unit

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.deploy.settings import DeploySettings

#: The chosen deployment, timed again after the run, may be this much over the budget before the report says so.
RECHECK_TOLERANCE = 0.05


def meet_budget(deploy: Any, prune: Any, model: nn.Module) -> PassResult:
    """Prune ``model`` just enough for its most accurate deployment to meet ``prune.target_latency``.

    A language model's candidates are its own (weight-only INT8/INT4 among them), timed by the decode step and
    scored by validation perplexity (:class:`optkit.passes.deploy.budget_tokens.TokenDeployer`); a ``tok/s``
    budget is a time per decode step (``batch`` tokens a step).

    Args:
        deploy: the run's bound ``deploy`` step (its settings, and the ``plan`` it reads later).
        prune: the ``structured_prune`` step holding the budget; it prunes the copies (see :func:`_pruner`).
        model: the model before pruning (not changed).

    Returns:
        the chosen point's model (``model`` itself when it needed no pruning), with details ``budget`` (the
        frontier, see :meth:`optkit.passes.deploy.search.SearchResult.section`) and ``notes``.

    Raises:
        OptkitError: for a decode speed (``tok/s``) on an image model, or when no candidate passes its checks or
            meets the budget.
    """
    from optkit.kinds import kind_of

    value, unit = budget_unit(prune.target_latency)
    language = kind_of(model).language_model
    if unit == "tok/s" and not language:
        raise OptkitError(f"--target-latency {prune.target_latency} is a language model's decode speed; give an image "
                          "model's budget in milliseconds per call (3ms) or as a fraction of its latency (0.5)")
    shape = tuple(prune.spec().input_shape)
    threads = deploy.threads or os.cpu_count() or 1
    # A name for the other kind of model is listed as unavailable, as deploy lists it.
    names = list(deploy.candidates or (TOKEN_CANDIDATES if language else CANDIDATES))
    scratch = Path(tempfile.mkdtemp(prefix="optkit-budget-"))
    try:
        if language:
            from optkit.passes.deploy.budget_tokens import TokenDeployer

            deployer = TokenDeployer(deploy, model, shape, threads, scratch)
        else:
            deployer = ImageDeployer(deploy, model, shape, threads, scratch)
        # A decode speed is a time per decode step: batch tokens a step.
        budget, measure = (deploy.batch * 1000.0 / value, "ms") if unit == "tok/s" else (value, unit)
        recalibration = None if language else _batchnorm_recalibration(model, deploy.calib_data, shape)
        pruner = _pruner(prune, deploy, model, shape, threads, language, recalibration)
        result = search(names, deployer, pruner, budget=budget,
                        unit=measure, unpruned_model=model, tokens_per_step=deploy.batch if language else None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per = "per decode step" if language else "per call"
    asked = {"fraction": f"{value:g} of the unpruned ONNX Runtime FP32 latency ({result.budget_ms:.2f} ms {per})",
             "ms": f"{value:g} ms {per}",
             "tok/s": f"{value:g} decode tokens/s ({result.budget_ms:.2f} ms per decode step)"}[unit]
    section = {**result.section(f"{asked} at batch {deploy.batch}, {threads} thread(s)"), "per": per}
    deploy.plan.update(deployment=result.chosen.name, budget=section)
    chosen = result.chosen
    images = f"{chosen.score['samples']} images of " if "samples" in chosen.score else ""
    note = (f"structured_prune: latency budget {asked}: {chosen.label} at {chosen.macs_fraction:.2f} of the MACs "
            f"measured {chosen.ms:.2f} ms, {result.metric} {score_figure(chosen, result.metric)} on {images}"
            f"{deploy.calib_data} (val), the best of {sum(p.score is not None for p in result.points)} "
            "deployment(s) that met it; "
            f"pruning efficiency {chosen.efficiency:.2f} (measured speed-up {chosen.speedup:.2f}x in {chosen.label} "
            f"x MACs kept {chosen.macs_fraction:.2f})"
            + (f"; its BatchNorm statistics re-estimated on {recalibration.batches} batches of {deploy.calib_data} "
               "(train), as every pruned try's were before it was scored"
               if recalibration is not None and result.model is not model else ""))
    notes = [note]
    if (warning := _near_chance(result, deploy.calib_data)) is not None:
        logging.getLogger(__name__).warning("warning: %s", warning)
        notes.append(warning)
    return PassResult(result.model, {"budget": section, "notes": notes})


def _near_chance(result: Any, data: str) -> str | None:
    """A warning when the chosen deployment's accuracy is no better than guessing among the data's classes: the
    budget was met by a model too small to be of use (the shipped Fashion-MNIST model at half its latency: 11 %
    on 10 classes)."""
    from optkit.analysis.accuracy import near_chance
    from optkit.data.specs import dataset_info

    if result.metric != "accuracy":
        return None
    try:
        classes = dataset_info(data).num_classes
    except DataError:  # data without classes (segmentation masks, detection boxes)
        return None
    accuracy = result.chosen.score["accuracy"]
    if classes < 2 or not near_chance(accuracy, classes):
        return None
    return (f"structured_prune: the chosen deployment scores {accuracy:.1%} on {data} (val), near chance "
            f"({1 / classes:.0%} for {classes} classes): this budget leaves too little of the model to be of use; "
            "give a larger budget, or fine-tune the result (--finetune)")


def _pruner(prune: Any, deploy: Any, model: nn.Module, shape: tuple[int, ...], threads: int, language: bool,
            recalibration: Any):
    """Copies of ``model`` pruned to an aim: an image model by the latency-target engine (the aim a fraction of its
    ONNX Runtime FP32 latency at the deployment's threads and batch; of the copies that reach it, the most accurate
    on the run's data); a language model to that fraction of its
    parameters (a decode step's time follows the weights it reads), with the run's text for the transformer
    engine. ``recalibration`` (a :class:`~optkit.passes.batchnorm.passes.RecalibrateBatchNorm`, or ``None``) is
    applied to each copy. Each returns a :class:`~optkit.passes.deploy.search.Pruned` (an image model's with the
    engine's own measured latency fraction and the copies it compared), or raises ``OptkitError`` for an aim the
    engine cannot reach."""
    import copy

    from optkit.model.stats import count_macs, count_params

    macs, params = count_macs(model, shape), count_params(model)

    def pruner(aim: float) -> Pruned:
        if language:
            engine = dataclasses.replace(prune, target_latency=None, target_params=aim, deployment=None,
                                         data=prune.data or deploy.calib_data,
                                         round_to=8 if prune.round_to == "auto" else prune.round_to)
        else:
            engine = dataclasses.replace(prune, target_latency=aim, deployment=None, latency_threads=threads,
                                         latency_batch=deploy.batch, data=prune.data or deploy.calib_data)
        try:
            result = engine.apply(copy.deepcopy(model))
        except ValueError as e:  # a target the engine cannot reach (a transformer's mix search says so)
            raise OptkitError(str(e)) from e
        pruned = result.model
        if recalibration is not None:
            recalibration.apply(pruned)
        fractions = count_macs(pruned, shape) / macs, count_params(pruned) / params
        if language:
            return Pruned(pruned, *fractions)
        return Pruned(pruned, *fractions, result.details.get("measured_fraction"), _engine_tries(result.details))

    return pruner


def _engine_tries(details: dict[str, Any]) -> list[dict[str, Any]] | None:
    """What the latency-target engine compared (its ``tries``), in brief: proposal, measured latency and MACs
    fractions, and the score of those it scored."""
    if "tries" not in details:
        return None
    keys = ("proposal", "measured_fraction", "macs_fraction", "score")
    return [{k: t[k] for k in keys if k in t} for t in details["tries"]]


def _batchnorm_recalibration(model: nn.Module, data: str, shape: tuple[int, ...]) -> Any:
    """The step that re-estimates a pruned copy's BatchNorm statistics on ``data``'s train split, as
    ``--recalibrate-bn`` does (``None`` for a model without BatchNorm).

    Cutting channels changes what every later BatchNorm sees, and statistics left from the unpruned model can
    put a pruned copy at chance (a mobilenet_v2 trained on Fashion-MNIST, cut to 0.49 of its MACs: 8 % val
    accuracy, 71 % recalibrated), so
    comparing copies by accuracy without this would compare how badly their statistics fit. Only statistics
    change, no weights; the copy chosen is shipped with them.
    """
    from torch import nn

    from optkit.passes.batchnorm.passes import RecalibrateBatchNorm

    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return None
    return RecalibrateBatchNorm(data=data, input_shape=shape)


class ImageDeployer:
    """Builds, times and scores an image model's candidates (see :class:`optkit.passes.deploy.search.Deployer`).

    Each model is exported to its own folder of ``scratch`` (verified against PyTorch) and built there with
    :func:`optkit.passes.deploy.choose.build_candidate`; timing interleaves the candidates with the unpruned
    model's ONNX Runtime FP32 file at the settings' batch and threads; scoring runs a candidate in its own
    runtime on the first images of the data's ``val`` split (as many as the search asks: see
    :data:`optkit.passes.deploy.search.SCORE_SAMPLES`).
    """

    metric = "accuracy"

    def __init__(self, settings: DeploySettings, model: nn.Module, shape: tuple[int, ...], threads: int,
                 scratch: Path):
        self.settings, self.shape, self.threads, self.scratch = settings, shape, threads, scratch
        self.tries = 0
        self.unpruned = self._export(model, "unpruned")
        self._batches: dict[int, Any] = {}

    def _export(self, model: nn.Module, name: str) -> Path:
        from optkit.export.onnx import export_onnx

        folder = self.scratch / name
        folder.mkdir()
        export_onnx(model, folder / "model.onnx", self.shape)
        return folder / "model.onnx"

    def build(self, name: str, model: nn.Module | None) -> Candidate:
        from optkit.passes.deploy.choose import build_candidate

        if model is None:
            source = self.unpruned
        else:
            self.tries += 1
            source = self._export(model, f"try{self.tries}")
        folder = source.parent / name
        folder.mkdir(exist_ok=True)
        return build_candidate(name, source, folder, self.settings, self.shape, self.threads)

    def time(self, candidates: Sequence[Candidate]) -> tuple[float, list[float]]:
        from optkit.analysis.latency import Deployment, interleaved_latency

        # The unpruned ONNX Runtime FP32 candidate is the baseline's own file: timed once, as the baseline.
        others = [c for c in candidates if not _is_baseline(c, self.unpruned)]
        timed = interleaved_latency([Deployment(self.unpruned),
                                     *(Deployment(c.built, c.runtime, c.precision) for c in others)],
                                    (self.settings.batch, *self.shape[1:]), threads=self.threads, warmup=3,
                                    repeats=self.settings.repeats)
        by_candidate = dict(zip(map(id, others), timed[1:]))
        return timed[0].median_ms, [by_candidate.get(id(c), timed[0]).median_ms for c in candidates]

    def baseline_alone(self) -> float:
        from optkit.analysis.fresh import call_fresh

        return call_fresh("optkit.analysis.latency:onnx_median_ms", path=str(self.unpruned),
                          input_shape=[self.settings.batch, *self.shape[1:]], threads=self.threads,
                          repeats=self.settings.repeats)

    def score(self, candidate: Candidate, samples: int) -> dict[str, float]:
        import numpy as np

        from optkit.passes.quantize.calibration import load_batches
        from optkit.runtime import openvino as ov
        from optkit.runtime.onnxrt import onnx_session

        if samples not in self._batches:
            self._batches[samples] = load_batches(self.settings.calib_data, "val", self.shape,
                                                  batch_size=self.settings.batch_size, samples=samples,
                                                  seed=self.settings.seed)
        batches = self._batches[samples]
        session = (ov.session(candidate.built, self.threads, precision=candidate.precision)
                   if candidate.runtime == "openvino" else onnx_session(candidate.built, self.threads))
        name = session.get_inputs()[0].name
        correct = total = 0
        for images, labels in zip(batches.inputs, batches.labels):
            logits = session.run(None, {name: images})[0]
            correct += int((np.argmax(logits, axis=1) == labels).sum())
            total += len(labels)
        return {"accuracy": correct / total, "samples": total}


def _is_baseline(candidate: Candidate, unpruned: Path) -> bool:
    return candidate.runtime == "onnxruntime" and Path(candidate.built) == unpruned


def recheck(budget: dict[str, Any], deployed: dict[str, Any]) -> str:
    """The note on the chosen deployment timed again by ``deploy`` (after any fine-tuning) against the budget."""
    # deploy's time, scaled as the search's are (to the unpruned file's time in a fresh process)
    in_run = next(c["latency"]["median_ms"] for c in deployed["candidates"] if c["status"] == "chosen")
    ms = in_run * budget["baseline_ms"] / deployed["baseline"]["median_ms"]
    limit = budget["budget_ms"]
    budget["remeasured_ms"] = round(ms, 4)
    budget["met_again"] = ms <= limit * (1 + RECHECK_TOLERANCE)
    verdict = ("within the budget" if ms <= limit else f"{ms / limit - 1:.1%} over the budget, within the "
               f"{RECHECK_TOLERANCE:.0%} timing tolerance" if budget["met_again"] else
               f"{ms / limit - 1:.1%} over the budget: the machine may be busier than during the search")
    return (f"latency budget {budget['asked']}: {deployed['label']} timed again at {ms:.2f} ms (scaled to a fresh "
            f"process, as the search's times are) against {limit:.2f} ms, {verdict}")


def plot_frontier(budget: dict[str, Any], path: str | os.PathLike) -> bool:
    """Draw each candidate's point (score against latency, the chosen one marked) and the budget line at ``path``.

    Returns:
        whether a plot was written (``False`` when no point was scored).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scored = [p for p in budget["points"] if p.get("score") and p.get("ms") is not None]
    if not scored:
        return False
    metric = budget["metric"]
    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for p in scored:
        value = p["score"][metric] * (100 if metric == "accuracy" else 1)
        chosen = p["status"] == "chosen"
        axes.scatter(p["ms"], value, s=90 if chosen else 40, marker="*" if chosen else "o",
                     color="tab:red" if chosen else "tab:blue", zorder=3)
        axes.annotate(f"{p['name']} (MACs {p['macs_fraction']:.2f})", (p["ms"], value), textcoords="offset points",
                      xytext=(5, 5), fontsize=8)
    axes.axvline(budget["budget_ms"], color="tab:red", linestyle="--", label=f"budget {budget['budget_ms']:.3g} ms")
    axes.set_xlabel(f"measured latency (ms {budget.get('per', 'per call')})")
    axes.set_ylabel("accuracy (%)" if metric == "accuracy" else metric)
    axes.set_title("Deployments that meet the budget, each pruned just enough", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=100, format="png")
    return True
