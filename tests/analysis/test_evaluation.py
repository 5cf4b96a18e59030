"""--eval: accuracy and fidelity at every stage, equal to an independent evaluation of what was saved."""

from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from optkit.analysis.evaluation import EvalSet, score
from optkit.cli import main
from optkit.data import load_dataset
from optkit.io.models import load_model

SPEC = "synthetic:200:3x32x32:10"


def _independent_accuracy(predict, samples: int) -> float:
    dataset = load_dataset(SPEC, "test", augment=False)
    correct = 0
    for i in range(samples):
        image, label = dataset[i]
        correct += int(predict(image.unsqueeze(0)).argmax() == label)
    return correct / samples


def test_report_figures_equal_an_independent_evaluation_of_the_saved_files(runner, tmp_path):
    out = tmp_path / "o"
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "10", "--input-shape",
                                  "1,3,32,32", "--prune", "0.3", "--export", "onnx", "--eval", SPEC,
                                  "--eval-samples", "150", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    evaluation = report["evaluation"]
    stages = {row["stage"]: row for row in evaluation["stages"]}
    assert list(stages) == ["original", "after structured_prune", "model.onnx (ONNX Runtime)"]
    assert evaluation["samples"] == 150 and evaluation["split"] == "test"

    model = load_model(out / "model.pt").eval()
    with torch.no_grad():
        saved = _independent_accuracy(lambda x: model(x)[0], 150)
    assert stages["after structured_prune"]["accuracy"] == pytest.approx(saved, abs=1e-12)
    # The summary's accuracy row is the same test images, before and after (not the fine-tune's val split).
    assert report["accuracy"]["after"] == pytest.approx(saved, abs=1e-12)
    assert report["accuracy"]["before"] == stages["original"]["accuracy"]
    assert "150 test images" in report["accuracy"]["dataset"]
    drop = (report["accuracy"]["after"] - report["accuracy"]["before"]) * 100
    assert f"| Accuracy | {report['accuracy']['before']:.2%} | {saved:.2%} | {drop:+.2f} pts |" in (
        out / "report.md").read_text()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    onnx = _independent_accuracy(lambda x: np.asarray(session.run(None, {name: x.numpy()})[0][0]), 150)
    assert stages["model.onnx (ONNX Runtime)"]["accuracy"] == pytest.approx(onnx, abs=1e-12)
    assert stages["original"]["agreement"] is None
    assert 0 <= stages["after structured_prune"]["agreement"] <= 1


def test_eval_data_the_model_does_not_fit_is_refused_before_any_pass(runner, tmp_path, monkeypatch):
    from optkit.passes.prune import passes

    started = []
    monkeypatch.setattr(passes.StructuredPrune, "apply", lambda self, model: started.append(1))
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "4", "--input-shape",
                                  "1,3,32,32", "--prune", "0.3", "--eval", SPEC, "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and started == []
    line = result.output.strip()
    assert "\n" not in line and "10 classes" in line and "--num-classes 10" in line


def test_eval_options_need_eval(runner, tmp_path):
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", "--eval-samples", "10"])
    assert result.exit_code == 2 and "add --eval SPEC" in result.output


def test_score_agreement_and_kl_match_their_definitions():
    reference = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    logits = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    eval_set = EvalSet("x", torch.zeros(4, 1), torch.tensor([0, 1, 2, 1]), 3)
    result = score(logits, eval_set, reference)
    assert result["accuracy"] == pytest.approx(3 / 4) and result["agreement"] == pytest.approx(2 / 4)
    p = torch.softmax(reference, 1)
    q = torch.softmax(logits, 1)
    expected = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(4)) / 4
    assert result["mean_kl"] == pytest.approx(expected, rel=1e-5)
    assert score(reference, eval_set, reference)["mean_kl"] == pytest.approx(0.0, abs=1e-7)
    assert math.isclose(score(logits, eval_set)["accuracy"], 0.75) and score(logits, eval_set)["agreement"] is None
