"""A decode budget (``--target-latency Ntok/s``) on a language model: its candidates timed by the decode step and
scored by validation perplexity, the lowest-perplexity one that meets the budget kept, and a budget none reaches
named in tokens/s. The model is the tiny trained Llama of ``test_tokens``; decode times are set, never measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from optkit.cli import main
from tests.support.trained_lm import trained_lm

pytest.importorskip("openvino")
LENGTH = 32
#: Decode ms per step by the graph's file name in the scratch folder (the baseline, FP32, first).
DECODE_MS = {"fp32": 2.0, "w8": 1.3, "w4": 1.0}


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path]:
    return trained_lm(tmp_path_factory.mktemp("budget-lm"), LENGTH, hidden=64)


@pytest.fixture
def decode_times(monkeypatch):
    def timer(paths, *, prompt_tokens, threads, batch, rounds=1):
        ms = [DECODE_MS["fp32"]] + [DECODE_MS[_precision(Path(p))] for p in paths[1:]]
        return [{"median_ms": v, "p90_ms": v, "tokens_per_s": round(batch * 1e3 / v, 1)} for v in ms]

    monkeypatch.setattr("optkit.passes.deploy.tokens.decode_timer", timer)
    monkeypatch.setattr("optkit.analysis.latency.interleaved_latency",
                        lambda deployments, shape, **kwargs: [_latency(d) for d in deployments])


def _precision(path: Path) -> str:
    parts = path.name.split(".")
    return parts[-2] if parts[-2] in DECODE_MS else "fp32"


def _latency(deployment):
    from optkit.analysis.latency import Latency

    return Latency(deployment.runtime, "cpu", 1, (1, LENGTH), 1, 5.0, 5.0, 5.0, 5.0, 1.0, 20, 3, 200.0,
                   deployment.precision)


def _optimize(folder: Path, corpus: Path, out: Path, budget: str, candidates: str):
    return CliRunner().invoke(main, ["optimize", str(folder), "--seq-len", str(LENGTH), "--target-latency", budget,
                                     "--export", "onnx", "--deploy", "--deploy-candidates", candidates,
                                     "--calib-data", f"text:{corpus}", "--no-latency", "--out", str(out)])


def test_a_decode_budget_keeps_the_lowest_perplexity_deployment_that_meets_it(lm, tmp_path, decode_times):
    # 700 tokens/s is 1.43 ms a step: weight-only INT8 (1.3 ms) and INT4 (1.0 ms) meet it unpruned.
    folder, corpus = lm
    out = tmp_path / "run"
    result = _optimize(folder, corpus, out, "700tok/s", "onnxruntime-w8,onnxruntime-w4")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    budget = report["deploy"]["budget"]
    assert budget["metric"] == "perplexity" and budget["per"] == "per decode step"
    assert budget["budget_ms"] == pytest.approx(1000 / 700, abs=1e-3)
    assert budget["asked"].startswith("700 decode tokens/s (1.43 ms per decode step)")
    points = {p["name"]: p for p in budget["points"]}
    assert {p["macs_fraction"] for p in points.values()} == {1.0}
    chosen = points[budget["chosen"]]
    other = next(p for p in points.values() if p is not chosen)
    assert chosen["score"]["perplexity"] <= other["score"]["perplexity"]
    assert report["deploy"]["precision"] == chosen["name"].split("-")[1]
    assert budget["remeasured_ms"] == DECODE_MS[chosen["name"].split("-")[1]] and budget["met_again"]
    assert "### Latency budget" in (out / "report.md").read_text()


def test_a_decode_budget_no_deployment_reaches_names_the_fastest_tokens_per_second(lm, tmp_path, decode_times):
    folder, corpus = lm
    # 5000 tokens/s is 0.2 ms a step, a fifth of INT4's 1.0 ms: no prune of the tiny model gets there (and the set
    # times do not fall with pruning), so the fastest reachable is INT4 unpruned.
    result = _optimize(folder, corpus, tmp_path / "o", "5000tok/s", "onnxruntime-w4")
    assert result.exit_code == 1
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "no deployment meets the budget of 5000.0 decode tokens/s: the fastest reachable is 1000.0 tokens/s" in line
    assert not (tmp_path / "o").exists()
