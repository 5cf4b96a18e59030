"""The real side of a latency budget (:mod:`optkit.passes.deploy.budget`) on a tiny conv net with a depthwise block:
the deployer's builds, timings and scores, and (slow) a whole run whose chosen deployment meets the budget when
timed again."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from optkit.core.errors import OptkitError
from optkit.core.pipeline import Pipeline
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.deploy.budget import ImageDeployer, plot_frontier, recheck
from optkit.passes.deploy.passes import Deploy
from optkit.passes.deploy.search import SCORE_SAMPLES
from optkit.passes.deploy.settings import DeploySettings
from optkit.passes.prune.passes import StructuredPrune

SHAPE = (1, 3, 16, 16)
DATA = "synthetic:64:3x16x16:4"


class Depthwise(nn.Module):
    """A stem, an inverted residual block (1x1 expand, 3x3 depthwise, 1x1 project), a head of 4 classes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.expand = nn.Sequential(nn.Conv2d(32, 64, 1), nn.BatchNorm2d(64), nn.ReLU())
        self.depthwise = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.BatchNorm2d(64), nn.ReLU())
        self.project = nn.Sequential(nn.Conv2d(64, 32, 1), nn.BatchNorm2d(32))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.project(self.depthwise(self.expand(x)))
        return self.head(x.mean(dim=(2, 3)))


def test_the_deployer_builds_times_and_scores_each_model_in_its_own_runtime(tmp_path):
    model = Depthwise().eval()
    settings = DeploySettings(calib_data=DATA, repeats=2, min_agreement=0.0, max_accuracy_drop=1.0)
    deployer = ImageDeployer(settings, model, SHAPE, 1, tmp_path)
    unpruned = deployer.build("onnxruntime-fp32", None)
    pruned_model = StructuredPrune(ratio=0.5, round_to=8, input_shape=SHAPE)(Depthwise().eval())
    pruned = deployer.build("onnxruntime-fp32", pruned_model)
    assert unpruned.status == pruned.status == "verified" and unpruned.built != pruned.built
    assert pruned.built.parent.name == "try1" and deployer.tries == 1
    baseline, times = deployer.time([unpruned, pruned])
    assert baseline > 0 and len(times) == 2 and all(ms > 0 for ms in times)
    assert times[0] == baseline  # the unpruned FP32 candidate is the baseline's own file: timed once
    assert 0.2 * baseline < deployer.baseline_alone() < 5 * baseline  # the same file, timed in a fresh process
    # The score is the model's own top-1 accuracy on the data's val split, run in ONNX Runtime.
    from optkit.passes.quantize.calibration import load_batches

    val = load_batches(DATA, "val", SHAPE, batch_size=64, samples=SCORE_SAMPLES)
    with torch.no_grad():
        expected = np.mean([int(p == y) for x, labels in zip(val.inputs, val.labels)
                            for p, y in zip(model(torch.from_numpy(x)).argmax(1).tolist(), labels)])
    score = deployer.score(unpruned, SCORE_SAMPLES)
    assert score["accuracy"] == pytest.approx(expected, abs=1.5 / val.samples) and score["samples"] == val.samples


def test_each_pruned_copy_is_shipped_and_scored_with_batchnorm_statistics_of_the_data(monkeypatch):
    """The search's pruner asks the engine for the copy most accurate on the data, and re-estimates that copy's
    BatchNorm statistics on the data's train split: the stem's running mean becomes the mean of its convolution's
    output over those images, computed here directly."""
    from optkit.core.contract import PassResult
    from optkit.data import load_dataset
    from optkit.passes.deploy.budget import _batchnorm_recalibration, _pruner

    model = Depthwise().eval()
    halved = StructuredPrune(ratio=0.5, round_to=8, input_shape=SHAPE)(Depthwise().eval())
    engines = []
    monkeypatch.setattr(StructuredPrune, "apply",
                        lambda self, m: engines.append(self) or PassResult(copy.deepcopy(halved), {
                            "measured_fraction": 0.47,
                            "tries": [{"proposal": "macs", "aim": 0.5, "measured_fraction": 0.47, "macs_fraction": 0.4,
                                       "removed_importance": 1.5, "score": {"accuracy": 0.6}},
                                      {"proposal": "blend", "aim": 0.5, "measured_fraction": 0.58,
                                       "macs_fraction": 0.45, "removed_importance": 1.0}]}))
    recalibration = _batchnorm_recalibration(model, DATA, SHAPE)
    engine = StructuredPrune(target_latency=0.5, input_shape=SHAPE)
    pruned, macs, params, measured, tries = _pruner(engine, DeploySettings(calib_data=DATA), model, SHAPE, 1,
                                                    False, recalibration)(0.5)

    images = torch.stack([image for image, _ in load_dataset(DATA, "train", augment=False)])
    assert len(images) % recalibration.batch_size == 0  # every image is in one of the equal batches
    with torch.no_grad():
        expected = pruned.stem[0](images).mean(dim=(0, 2, 3))
    torch.testing.assert_close(pruned.stem[1].running_mean, expected, rtol=1e-4, atol=1e-5)
    assert pruned.stem[1].num_features == 16 and 0.2 < macs < 0.5 and 0.2 < params < 0.5
    assert measured == 0.47  # the engine's own measure of the copy's latency, kept beside the search's
    # and what it compared, in brief
    assert tries == [{"proposal": "macs", "measured_fraction": 0.47, "macs_fraction": 0.4, "score": {"accuracy": 0.6}},
                     {"proposal": "blend", "measured_fraction": 0.58, "macs_fraction": 0.45}]
    assert torch.equal(model.stem[1].running_mean, torch.zeros(32))  # the caller's model is as it was
    assert _batchnorm_recalibration(nn.Sequential(nn.Conv2d(3, 4, 1)), DATA, SHAPE) is None
    # the engine chooses among the copies that reach the aim by accuracy on the run's data
    assert [(e.target_latency, e.data) for e in engines] == [(0.5, DATA)]


def test_recheck_and_plot_say_whether_the_chosen_deployment_still_meets_the_budget(tmp_path):
    points = [{"name": "onnxruntime-fp32", "status": "met", "ms": 2.9, "macs_fraction": 0.6,
               "score": {"accuracy": 0.90}, "tries": []},
              {"name": "openvino-int8", "status": "chosen", "ms": 2.5, "macs_fraction": 0.9,
               "score": {"accuracy": 0.91}, "tries": []},
              {"name": "openvino-bf16", "status": "missed", "ms": 4.0, "macs_fraction": 0.2, "score": None,
               "tries": []}]
    budget = {"asked": "3 ms per call", "budget_ms": 3.0, "baseline_ms": 8.0, "metric": "accuracy", "points": points}
    # deploy's process runs the unpruned file at 10 ms where a fresh one ran it at 8: its times are scaled by 0.8
    deployed = {"label": "OpenVINO INT8", "candidates": [{"status": "chosen", "latency": {"median_ms": 3.875}}],
                "baseline": {"median_ms": 10.0}}
    note = recheck(budget, deployed)
    assert budget["met_again"] is True and budget["remeasured_ms"] == 3.1
    assert "3.3% over the budget, within the 5% timing tolerance" in note
    deployed["candidates"][0]["latency"]["median_ms"] = 4.125
    assert "over the budget: the machine may be busier" in recheck(budget, deployed) and not budget["met_again"]
    assert plot_frontier(budget, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert not plot_frontier({**budget, "points": points[2:]}, tmp_path / "none.png")


def test_a_budget_in_a_pipeline_without_deploy_or_data_is_refused_when_the_pipeline_is_built():
    with pytest.raises(OptkitError, match="is met in a deployment: add --deploy"):
        Pipeline([StructuredPrune(target_latency="2ms"), ExportOnnx()], input_shape=SHAPE)
    with pytest.raises(OptkitError, match="needs data to score them on"):
        Pipeline([StructuredPrune(target_latency=0.5), ExportOnnx(), Deploy()], input_shape=SHAPE)
    with pytest.raises(OptkitError, match="is a budget met in a deployment"):
        StructuredPrune(target_latency="2ms", input_shape=SHAPE)(Depthwise().eval())


@pytest.mark.slow
def test_a_pipeline_meets_a_budget_measured_again_in_the_chosen_deployment(tmp_path):
    """Real pruning, building and timing (minutes): the chosen deployment, timed again by deploy, is within the
    budget's timing tolerance, and the frontier lists every candidate."""
    from optkit.core.context import RunContext

    model = Depthwise().eval()
    pipeline = Pipeline([StructuredPrune(target_latency=0.7, round_to=8),
                         ExportOnnx(path=str(tmp_path / "model.onnx")),
                         Deploy(calib_data=DATA, threads=1, repeats=20, min_agreement=0.0, max_accuracy_drop=1.0,
                                candidates=("onnxruntime-fp32", "onnxruntime-int8"))], input_shape=SHAPE)
    run = pipeline.run(model, context=RunContext(out_dir=tmp_path))
    deploy = run.records[-1].details
    budget = deploy["budget"]
    assert {p["name"] for p in budget["points"]} == {"onnxruntime-fp32", "onnxruntime-int8"}
    chosen = next(p for p in budget["points"] if p["status"] == "chosen")
    assert chosen["ms"] <= budget["budget_ms"] and chosen["score"]["accuracy"] >= 0.0
    assert budget["met_again"], json.dumps(budget, indent=1)
    pruned_tries = [t for p in budget["points"] for t in p["tries"] if t["ms"] is not None and t["aim"] < 1.0]
    assert pruned_tries and all(0.0 < t["pruner_fraction"] < 1.5 for t in pruned_tries)
    # each lists the engine's copies, the kept one among them
    assert all(any(e["measured_fraction"] == t["pruner_fraction"] for e in t["pruner_tries"]) for t in pruned_tries)
    assert (tmp_path / "frontier.png").is_file()


def test_a_budget_met_only_by_a_model_near_chance_is_warned_about():
    from types import SimpleNamespace

    from optkit.passes.deploy.budget import _near_chance

    def result(accuracy, metric="accuracy"):
        return SimpleNamespace(metric=metric, chosen=SimpleNamespace(score={metric: accuracy}))

    # 4 classes: chance 25 %, and 5 points above it still counts as guessing
    warning = _near_chance(result(0.29), DATA)
    assert warning.startswith("structured_prune: the chosen deployment scores 29.0% on synthetic:64:3x16x16:4 (val)")
    assert "near chance (25% for 4 classes)" in warning and "larger budget" in warning
    assert _near_chance(result(0.31), DATA) is None
    assert _near_chance(result(3.5, metric="perplexity"), "text") is None
