"""``--target-latency`` with ``--deploy`` on optimize: the frontier in the report, only the chosen deployment
written, and the refusals (a zero or negative budget, no data to score on, ``--int8``), each one line with nothing
written. Timings are set (``set_times``), never measured, except where a test says so."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from optkit.cli import main
from optkit.demo import FASHION_RESNET


def _optimize(*args):
    return CliRunner().invoke(main, ["optimize", str(FASHION_RESNET), *map(str, args)])


def test_a_budget_met_unpruned_keeps_the_most_accurate_deployment_and_reports_the_frontier(tmp_path, fashion_data,
                                                                                         set_times):
    # The unpruned FP32 file takes 8 ms; both candidates meet 3 ms without pruning, so the search prunes nothing
    # and the more accurate (then the faster) is kept.
    set_times({("onnxruntime", None): 8.0, ("onnxruntime", "int8"): 2.5, ("openvino", "fp32"): 2.0})
    out = tmp_path / "run"
    result = _optimize("--target-latency", "3ms", "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--deploy-candidates", "onnxruntime-int8,openvino-fp32", "--deploy-threads", 1,
                       "--deploy-batch", 1, "--deploy-repeats", 2, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    budget = report["deploy"]["budget"]
    assert budget["budget_ms"] == 3.0 and budget["asked"] == "3 ms per call at batch 1, 1 thread(s)"
    points = {p["name"]: p for p in budget["points"]}
    chosen = points[budget["chosen"]]
    assert chosen["status"] == "chosen" and chosen["name"] == f"{report['deploy']['runtime']}-" \
                                                             f"{report['deploy']['precision']}"
    assert all(p["ms"] <= 3.0 and p["macs_fraction"] == 1.0 for p in points.values())
    other = next(p for p in points.values() if p is not chosen)
    assert (chosen["score"]["accuracy"], -chosen["ms"]) > (other["score"]["accuracy"], -other["ms"])
    assert chosen["score"]["accuracy"] > 0.85  # the demo model on Fashion-MNIST's val split
    assert budget["remeasured_ms"] == (2.5 if chosen["name"] == "onnxruntime-int8" else 2.0)
    assert budget["met_again"] is True
    (note,) = [n for n in report["notes"] if n.startswith("structured_prune: latency budget 3 ms per call")]
    assert note.endswith("pruning efficiency 1.00 (measured speed-up 1.00x in "
                         f"{report['deploy']['label']} x MACs kept 1.00)")
    written = {p.name for p in out.iterdir()}
    assert "frontier.png" in written and (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert ({"model.xml", "model.bin"} <= written) == (chosen["name"] == "openvino-fp32")
    assert ("model.int8.onnx" in written) == (chosen["name"] == "onnxruntime-int8")
    markdown = (out / "report.md").read_text()
    assert "### Latency budget" in markdown and f"| **{chosen['name']}** (chosen) | chosen | 1.000 |" in markdown
    assert "![accuracy against measured latency" in markdown
    assert 'target_latency = "3ms"' in (out / "recipe.toml").read_text()


@pytest.mark.parametrize("value, message", [
    ("0", "target_latency must be above 0"),
    ("-0.5", "target_latency must be above 0"),
    ("0ms", "target_latency must be above 0"),
    ("-3ms", "target_latency must be above 0"),
    ("0tok/s", "target_latency must be above 0"),
    ("3", "a budget in milliseconds is written with its unit: 3ms"),
    ("3 seconds", "milliseconds per call (3ms) or decode tokens/s (40tok/s)"),
])
def test_a_budget_that_is_not_positive_or_has_no_unit_is_refused(tmp_path, value, message):
    result = _optimize("--target-latency", value, "--export", "onnx", "--deploy", "--calib-data", "fashion-mnist",
                       "--out", tmp_path / "o")
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert message in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, message", [
    (["--target-latency", "3ms", "--export", "onnx", "--deploy"],
     "Error: --target-latency 3ms with --deploy keeps the most accurate deployment that meets it, so it needs data "
     "to score them on: give --calib-data SPEC"),
    (["--target-latency", "0.5", "--export", "onnx", "--deploy", "--random-calibration"],
     "so it needs data to score them on"),
    (["--target-latency", "0.5", "--export", "onnx", "--int8", "--calib-data", "fashion-mnist"],
     "Error: --target-latency is met in the deployment it measures, and --int8 would change that afterwards: drop "
     "--int8 (--deploy tries INT8 within the budget)"),
    (["--target-latency", "3ms", "--export", "onnx"], "Error: --target-latency 3ms is met in a deployment: add --deploy"),
])
def test_a_budget_the_run_cannot_serve_is_one_line_and_writes_nothing(tmp_path, extra, message):
    result = _optimize(*extra, "--out", tmp_path / "o")
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and message in result.output
    assert not (tmp_path / "o").exists()


def test_a_decode_budget_on_an_image_model_is_an_error_line_and_writes_nothing(tmp_path, fashion_data):
    # Refused when the model is seen (after the progress lines of the run's start), before anything is pruned.
    result = _optimize("--target-latency", "40tok/s", "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--out", tmp_path / "o")
    assert result.exit_code == 1
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "40tok/s is a language model's decode speed" in line and line == result.output.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()


def test_a_candidate_for_language_models_is_listed_unavailable_on_an_image_model(tmp_path, fashion_data, set_times):
    set_times({("onnxruntime", None): 8.0, ("openvino", "fp32"): 2.0})
    out = tmp_path / "run"
    result = _optimize("--target-latency", "3ms", "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--deploy-candidates", "openvino-fp32,onnxruntime-w4", "--deploy-threads", 1, "--out", out)
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in json.loads((out / "report.json").read_text())["deploy"]["budget"]["points"]}
    assert points["openvino-fp32"]["status"] == "chosen"
    assert points["onnxruntime-w4"]["status"] == "unavailable"
    assert points["onnxruntime-w4"]["reason"] == "onnxruntime-w4 is for language models (weight-only quantization)"


@pytest.mark.slow  # a fine-tune with its validation: about 45 s on 2 cores
def test_only_the_chosen_model_is_fine_tuned_then_deployed(tmp_path, fashion_data, set_times):
    set_times({("onnxruntime", None): 8.0, ("onnxruntime", "int8"): 2.5, ("openvino", "fp32"): 2.0})
    out = tmp_path / "run"
    result = _optimize("--target-latency", "3ms", "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--deploy-candidates", "onnxruntime-int8,openvino-fp32", "--deploy-threads", 1,
                       "--finetune", fashion_data, "--max-steps", 2, "--batch-size", 16, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in report["passes"]] == ["structured_prune", "finetune"]  # the PyTorch passes
    assert 'name = "deploy"' in (out / "recipe.toml").read_text()
    budget = report["deploy"]["budget"]
    # deploy built only the planned deployment, from the fine-tuned model
    assert [c["name"] for c in report["deploy"]["candidates"]] == [budget["chosen"]]
    assert budget["met_again"]


def test_a_budget_no_deployment_reaches_names_the_fastest_latency_and_writes_nothing(tmp_path, fashion_data,
                                                                                      set_times):
    # 0.4 ms is 0.08 of OpenVINO's 5 ms: below the search's floor, so nothing is pruned for it.
    set_times({("onnxruntime", None): 8.0, ("openvino", "fp32"): 5.0})
    result = _optimize("--target-latency", "0.4ms", "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--deploy-candidates", "openvino-fp32", "--out", tmp_path / "o")
    assert result.exit_code == 1
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert ("no deployment meets the budget of 0.40 ms per call: the fastest reachable is 5.00 ms (OpenVINO FP32 at "
            "1.00 of the MACs); give --target-latency 5.25ms or more; nothing was written") in line
    assert not (tmp_path / "o").exists()
