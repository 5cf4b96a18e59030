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
                                  "--eval-samples", "150", "--no-latency", "--out", str(out)])
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
    # Not mirrored row for row, so KL in the wrong direction would not match either.
    logits = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.5, 2.0], [0.0, 1.0, 0.5]])
    eval_set = EvalSet("x", torch.zeros(4, 1), torch.tensor([0, 1, 2, 1]), 3)
    result = score(logits, eval_set, reference)
    assert result["accuracy"] == pytest.approx(3 / 4) and result["agreement"] == pytest.approx(2 / 4)
    p = torch.softmax(reference, 1)
    q = torch.softmax(logits, 1)
    expected = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(4)) / 4
    assert result["mean_kl"] == pytest.approx(expected, rel=1e-5)
    assert score(reference, eval_set, reference)["mean_kl"] == pytest.approx(0.0, abs=1e-7)
    assert math.isclose(score(logits, eval_set)["accuracy"], 0.75) and score(logits, eval_set)["agreement"] is None


def test_a_class_the_original_ties_first_agrees():
    reference = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.999, 0.0]])
    logits = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    eval_set = EvalSet("x", torch.zeros(3, 1), torch.tensor([0, 1, 2]), 3)
    assert score(logits, eval_set, reference)["agreement"] == pytest.approx(1 / 3)


def test_mean_kl_is_from_the_original_to_this_model_on_an_asymmetric_case():
    """Guards the KL direction: KL(original || this), which differs from KL(this || original) here."""
    # Row 0: original (0.5, 0.5), this (0.9, 0.1). Row 1: original (0.05, 0.95), this (0.5, 0.5).
    reference = torch.tensor([[0.5, 0.5], [0.05, 0.95]]).log()
    logits = torch.tensor([[0.9, 0.1], [0.5, 0.5]]).log()
    eval_set = EvalSet("x", torch.zeros(2, 1), torch.tensor([0, 1]), 2)
    p = np.array([[0.5, 0.5], [0.05, 0.95]])
    q = np.array([[0.9, 0.1], [0.5, 0.5]])
    forward = float(np.mean(np.sum(p * np.log(p / q), axis=1)))  # KL(original || this), per row, averaged
    backward = float(np.mean(np.sum(q * np.log(q / p), axis=1)))
    assert abs(forward - backward) > 0.05  # the two directions are far apart on these data
    # Row 0 by hand: 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.510826; row 1: 0.05 ln 0.1 + 0.95 ln 1.9 = 0.494630.
    assert forward == pytest.approx((0.510826 + 0.494630) / 2, abs=1e-5)
    assert score(logits, eval_set, reference)["mean_kl"] == pytest.approx(forward, rel=1e-5)
    # Swapping the roles scores the other direction.
    assert score(reference, eval_set, logits)["mean_kl"] == pytest.approx(backward, rel=1e-5)


def test_score_on_fewer_logits_than_reference_uses_the_first_rows_of_each():
    """ONNX Runtime with a static batch drops the last partial batch: scores cover only the rows it returned."""
    reference = torch.tensor([[3.0, 0.0, 1.0], [0.0, 2.0, 1.0], [1.0, 0.0, 4.0], [0.0, 5.0, 0.0], [2.0, 1.0, 0.0]])
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [0.0, 0.0, 1.0]])
    eval_set = EvalSet("x", torch.zeros(5, 1), torch.tensor([1, 2, 0, 1, 0]), 3)
    result = score(logits, eval_set, reference)
    assert result["samples"] == 3
    assert result["accuracy"] == pytest.approx(1 / 3)  # argmax 0, 2, 2 against labels 1, 2, 0
    assert result["agreement"] == pytest.approx(2 / 3)  # against the original's argmax 0, 1, 2
    p = torch.softmax(reference[:3].double(), 1).numpy()
    q = torch.softmax(logits.double(), 1).numpy()
    assert result["mean_kl"] == pytest.approx(float(np.mean(np.sum(p * np.log(p / q), axis=1))), rel=1e-5)


class _DropoutNet(torch.nn.Module):
    """Dropout and a BatchNorm: the output differs between train and eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def test_torch_logits_are_the_eval_mode_outputs_over_uneven_batches():
    """Guards the batching (7 images in batches of 3) and eval mode (dropout and BatchNorm statistics off)."""
    from optkit.analysis.evaluation import torch_logits

    torch.manual_seed(3)
    model = _DropoutNet()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        model.bn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    images = torch.randn(7, 4)
    eval_set = EvalSet("x", images, torch.zeros(7, dtype=torch.long), 3)
    # Eval mode by hand: no dropout, BatchNorm with its running statistics.
    z = images @ model.fc.weight.detach().T + model.fc.bias.detach()
    expected = (z - model.bn.running_mean) / (model.bn.running_var + model.bn.eps).sqrt() * model.bn.weight.detach() \
        + model.bn.bias.detach()
    logits = torch_logits(model, eval_set, batch_size=3)
    assert logits.shape == (7, 3)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    assert model.training  # the caller's mode is given back


def _matmul_onnx(path, batch) -> np.ndarray:
    """A one-MatMul ONNX file with the given batch dimension (an int: static; a string: dynamic); returns its weight."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return weight


@pytest.mark.parametrize(("batch", "rows"), [(2, 4), ("N", 5)], ids=["static-2", "dynamic"])
def test_onnx_logits_cover_whole_batches_of_a_static_file(tmp_path, batch, rows):
    """A static batch of 2 scores 4 of 5 images (the partial batch is dropped); a dynamic one scores all 5."""
    from optkit.analysis.evaluation import onnx_logits

    weight = _matmul_onnx(tmp_path / "m.onnx", batch)
    images = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    eval_set = EvalSet("x", images, torch.zeros(5, dtype=torch.long), 3)
    logits = onnx_logits(tmp_path / "m.onnx", eval_set, batch_size=3)
    assert logits.shape == (rows, 3)
    assert np.allclose(logits.numpy(), images[:rows].numpy() @ weight, atol=1e-5)
