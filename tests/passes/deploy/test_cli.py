"""``--openvino`` and ``--deploy`` on optimize and export: the files, the report's runtime and precision, the
refusals, and the one-line note without OpenVINO (timings are set, never measured)."""

from __future__ import annotations

import json
import sys

import numpy as np
import openvino
import pytest
import torch
from click.testing import CliRunner

from optkit.cli import main
from optkit.demo import FASHION_RESNET
from optkit.io import models
from optkit.runtime import openvino as ov

ARCH = "optkit.demo.fashion_resnet:FashionResNet"
#: bf16 where the CPU has it (the fastest set here), else fp32, so the same runs pass on any x86 CPU.
FAST = "bf16" if ov.cpu_has_bf16() else "fp32"


def _optimize(*args):
    return CliRunner().invoke(main, ["optimize", str(FASHION_RESNET), *map(str, args)])


def _export(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)])


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The demo model as a plain state_dict file, read back with ``--arch``."""
    path = tmp_path_factory.mktemp("weights") / "fashion.pt"
    torch.save(models.load(str(FASHION_RESNET)).model.state_dict(), path)
    return path


def test_optimize_deploy_writes_the_chosen_deployment_and_reports_its_runtime(tmp_path, fashion_data, set_times):
    set_times({("onnxruntime", None): 8.0, ("onnxruntime", "fp32"): 5.0, ("openvino", FAST): 2.0})
    result = _optimize("--prune", 0.25, "--round-to", 2, "--export", "onnx", "--deploy", "--calib-data", fashion_data,
                       "--deploy-candidates", f"onnxruntime-fp32,openvino-{FAST}", "--deploy-threads", 1,
                       "--deploy-batch", 1, "--deploy-min-gain", 0.05, "--deploy-repeats", 4,
                       "--min-agreement", 0.97, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert {"model.onnx", "model.xml", "model.bin"} <= {p.name for p in tmp_path.iterdir()}
    report = json.loads((tmp_path / "report.json").read_text())
    deploy = report["deploy"]
    assert (deploy["runtime"], deploy["precision"], deploy["threads"], deploy["batch_size"]) == ("openvino", FAST, 1, 1)
    assert deploy["speedup"] == 4.0 and {"model.xml", "model.bin"} <= set(report["files"])
    label = f"OpenVINO {FAST if FAST == 'bf16' else 'FP32'} ms vs unpruned ONNX Runtime FP32 (1 thr, batch 1)"
    assert f"| {label} | 8.00 | 2.00 | 0.250× |" in (tmp_path / "report.md").read_text()
    assert 'name = "deploy"' in (tmp_path / "recipe.toml").read_text()
    compiled = openvino.Core().compile_model(str(tmp_path / "model.xml"), "CPU")
    assert compiled({0: np.zeros((1, 1, 28, 28), np.float32)})[0].shape == (1, 10)


def test_optimize_openvino_writes_the_ir_and_its_latency_row(tmp_path, set_times):
    set_times({("onnxruntime", None): 3.0, ("openvino", "fp32"): 2.0})
    result = _optimize("--export", "onnx", "--openvino", "fp32", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["openvino"]["precision"] == "fp32" and report["openvino"]["compute"] == "f32"
    assert {"model.xml", "model.bin"} <= set(report["files"])
    markdown = (tmp_path / "report.md").read_text()
    assert "| OpenVINO fp32 vs ONNX Runtime FP32 ms (" in markdown and "| 3.00 | 2.00 | 0.667× |" in markdown
    assert ov.MISSING_NOTE not in markdown


def test_without_openvino_the_report_says_in_one_line_what_it_would_add(weights, tmp_path, set_times, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    set_times({})
    result = _optimize("--export", "onnx", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    notes = json.loads((tmp_path / "report.json").read_text())["notes"]
    assert notes.count(ov.MISSING_NOTE) == 1 and "pip install -e '.[openvino]'" in ov.MISSING_NOTE
    failed = _export(weights, "--arch", ARCH, "--onnx", tmp_path / "again.onnx", "--openvino", "fp32")
    assert failed.exit_code == 1 and "OpenVINO is not installed (pip install -e '.[openvino]')" in failed.output
    assert not (tmp_path / "again.onnx").exists()


def test_export_openvino_int8_writes_the_ir_beside_the_onnx_file(weights, tmp_path, fashion_data, set_times):
    set_times({})
    onnx_path = tmp_path / "fashion.onnx"
    result = _export(weights, "--arch", ARCH, "--input-shape", "1,1,28,28", "--onnx", onnx_path,
                     "--openvino", "int8", "--calib-data", fashion_data)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fashion.bin", "fashion.onnx", "fashion.xml"]
    assert "note: fashion.xml: OpenVINO int8 (compile with INFERENCE_PRECISION_HINT" in result.output
    assert ov.recorded_precision(ov.read(tmp_path / "fashion.xml")) == "int8"


def test_export_deploy_lists_every_candidate(weights, tmp_path, fashion_data, set_times):
    set_times({("onnxruntime", None): 4.0, ("onnxruntime", "fp32"): 4.0, ("onnxruntime", "int8"): 5.0})
    onnx_path = tmp_path / "fashion.onnx"
    result = _export(weights, "--arch", ARCH, "--input-shape", "1,1,28,28", "--onnx", onnx_path, "--deploy",
                     "--deploy-candidates", "onnxruntime-fp32,onnxruntime-int8", "--calib-data", fashion_data,
                     "--deploy-threads", 1, "--deploy-batch", 2, "--deploy-min-gain", 0.0, "--deploy-repeats", 2)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fashion.onnx"]
    assert "note: deployment: ONNX Runtime FP32 is the fastest that passed its checks at 1 thread(s), batch 2" in \
        result.output
    assert "note: deployment candidate ONNX Runtime INT8: 5.00 ms (0.80x); refused: slower than onnxruntime-fp32" \
        in result.output


@pytest.mark.parametrize("extra, message", [
    (["--deploy", "--int8"], "--deploy chooses among ONNX Runtime INT8 and OpenVINO itself"),
    (["--deploy", "--openvino", "fp32"], "--deploy chooses among ONNX Runtime INT8 and OpenVINO itself"),
    (["--deploy-threads", "2"], "--deploy-threads set how --deploy chooses: add --deploy"),
    (["--deploy-candidates", "openvino-int4"], "deployment candidates must be names among onnxruntime-fp32"),
])
def test_export_refuses_deployment_flags_that_do_not_fit(weights, tmp_path, extra, message):
    result = _export(weights, "--arch", ARCH, "--onnx", tmp_path / "fashion.onnx", *extra)
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_openvino_on_another_device_before_timing_anything():
    result = CliRunner().invoke(main, ["bench", str(FASHION_RESNET), "--engine", "openvino", "--device", "cuda"])
    assert result.exit_code == 2
    assert "optkit runs OpenVINO on the CPU: use --device cpu with --engine openvino" in " ".join(result.output.split())
