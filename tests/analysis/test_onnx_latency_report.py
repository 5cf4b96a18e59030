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


def test_no_latency_skips_the_timing(runner, tmp_path):
    result = _optimize(runner, tmp_path / "o", "--no-latency")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert "onnx_latency" not in report
