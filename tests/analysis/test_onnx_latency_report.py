"""optimize --export onnx times the original and the result in ONNX Runtime by default (structure only: no timing asserts)."""

from __future__ import annotations

import json
import os

import pytest

from optkit.cli import main


def _optimize(runner, out, *extra):
    return runner.invoke(main, ["optimize", "torchvision:squeezenet1_1", "--num-classes", "10", "--input-shape",
                                "1,3,32,32", "--prune", "0.3", "--export", "onnx", "--out", str(out), *extra])


def test_the_report_puts_the_realized_speedup_next_to_the_macs_ratio(runner, tmp_path):
    result = _optimize(runner, tmp_path / "o")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    timing = report["onnx_latency"]
    assert timing["threads"] == os.cpu_count() and timing["batch_size"] == 1
    before, after = timing["before"]["median_ms"], timing["after"]["median_ms"]
    assert before > 0 and after > 0
    assert timing["speedup"] == pytest.approx(before / after, rel=1e-2)
    macs_ratio = report["after"]["macs"] / report["before"]["macs"]
    assert timing["ideal_speedup"] == pytest.approx(1 / macs_ratio, rel=1e-2)
    assert timing["efficiency"] == pytest.approx(timing["speedup"] / timing["ideal_speedup"], rel=1e-2)
    assert any(n.startswith("ONNX Runtime, batch 1") and "efficiency" in n for n in report["notes"])
    assert "Latency was not measured" not in " ".join(report["notes"])


@pytest.mark.slow  # 17 s of timing; the symbolic-batch rule is tested below without timing
def test_a_model_faster_than_the_per_call_cost_is_also_timed_at_a_larger_batch(runner, tmp_path, monkeypatch):
    from optkit import workflow

    # Every model counts as tiny: the rule, not this machine's speed, decides that a second batch is timed.
    monkeypatch.setattr(workflow, "OVERHEAD_BOUND_MS", 1e9)
    monkeypatch.setattr(workflow, "COMPUTE_MS", 1e9)
    monkeypatch.setattr(workflow, "MAX_COMPUTE_BATCH", 4)
    result = _optimize(runner, tmp_path / "o")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    larger = report["onnx_latency"]["at_batch"]
    assert larger["batch_size"] == 4
    before, after = larger["before"]["median_ms"], larger["after"]["median_ms"]
    assert larger["speedup"] == pytest.approx(before / after, rel=1e-2)
    assert larger["before"]["input_shape"][0] == larger["batch_size"]
    text = (tmp_path / "o" / "report.md").read_text()
    assert f"ONNX Runtime ms ({os.cpu_count()} thr, batch {larger['batch_size']})" in text
    assert any(f"also timed at batch {larger['batch_size']}" in n for n in report["notes"])


def test_no_latency_skips_the_timing(runner, tmp_path):
    result = _optimize(runner, tmp_path / "o", "--no-latency")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert "onnx_latency" not in report


def test_only_files_with_a_symbolic_batch_take_the_larger_batch(tmp_path):
    import torch

    from optkit.export.onnx import export_onnx
    from optkit.workflow import _takes_any_batch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    export_onnx(model, tmp_path / "any.onnx", (1, 3, 8, 8), dynamic_batch=True)
    export_onnx(model, tmp_path / "fixed.onnx", (1, 3, 8, 8), dynamic_batch=False)
    assert _takes_any_batch(tmp_path / "any.onnx") and not _takes_any_batch(tmp_path / "fixed.onnx")


@pytest.mark.slow  # about a minute of ONNX Runtime timing; tests/passes/prune/targets/test_latency.py covers the search
def test_target_latency_from_the_command_line_reports_what_it_measured(runner, tmp_path):
    from optkit.passes.prune.targets.latency import PROPOSALS

    out = tmp_path / "o"
    result = runner.invoke(main, ["optimize", "torchvision:squeezenet1_1", "--num-classes", "10", "--input-shape",
                                  "1,3,64,64", "--target-latency", "0.6", "--threads", "1", "--export", "onnx",
                                  "--out", str(out)], env={"OPTKIT_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    details = report["passes"][0]["details"]
    assert details["proposal"] in PROPOSALS and details["threads"] == 1 and details["batch"] == 1
    kept = [t for t in details["tries"] if t["proposal"] == details["proposal"]
            and t["measured_fraction"] == details["measured_fraction"]]
    assert kept and kept[0]["macs_fraction"] == pytest.approx(details["macs_fraction"], abs=1e-4)
    # The MACs the report counts are the kept try's.
    assert report["after"]["macs"] / report["before"]["macs"] == pytest.approx(details["macs_fraction"], abs=2e-3)
    assert any(n.startswith("structured_prune: latency ") and details["proposal"] in n for n in report["notes"])
    assert (out / "model.onnx").exists()
