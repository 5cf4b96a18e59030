"""The report's generation section (:mod:`optkit.analysis.generation`): each decode figure sits where it belongs.

The timings are fakes with before and after far apart (and the load average quiet), so a line that prints one
figure in the other's place reads differently.
"""

from __future__ import annotations

import itertools

import pytest
from torch import nn

from optkit.analysis import generation, latency
from optkit.export import decode

BEFORE = {"median_ms": 20.0, "p90_ms": 21.0, "tokens_per_s": 50.0, "threads": 2}
AFTER = {"median_ms": 8.0, "p90_ms": 8.4, "tokens_per_s": 125.0, "threads": 2}
ONNX_BEFORE = {"median_ms": 10.0, "p90_ms": 10.5, "tokens_per_s": 100.0, "threads": 2}
ONNX_AFTER = {"median_ms": 2.5, "p90_ms": 2.6, "tokens_per_s": 400.0, "threads": 2}


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(latency, "load_average", lambda: 0.1)
    monkeypatch.setattr(latency, "usable_cores", lambda: 2)


def _line(lines: list[str], label: str) -> str:
    (line,) = [line for line in lines if f"{label}:" in line]
    return line


def test_each_decode_line_reads_before_then_after_and_their_speed_up(quiet):
    section = {"decode_prompt_tokens": 8, "pytorch": generation._pair(dict(BEFORE), dict(AFTER)),
               "onnxruntime": generation._pair(dict(ONNX_BEFORE), dict(ONNX_AFTER)), "prompt": "a",
               "prompt_ids": [0], "sample_tokens": 2, "before": {"text": "a b", "ids": [1]},
               "after": {"text": "a c", "ids": [2]}, "notes": []}
    lines = generation.generation_lines(section)
    assert _line(lines, "PyTorch").endswith("PyTorch: 50 -> 125 tokens/s (2.50x)")
    assert _line(lines, "ONNX Runtime").endswith("ONNX Runtime: 100 -> 400 tokens/s (4.00x)")


def test_the_probe_reports_the_original_before_and_the_result_after(quiet, monkeypatch, tmp_path):
    """:meth:`GenerationProbe.finish` pairs the original's timing (taken at the start) with the result's."""
    torch_speeds = iter([dict(BEFORE), dict(AFTER)])
    samples = iter([[1, 2], [3, 4]])
    monkeypatch.setattr(decode, "unsupported", lambda model: None)
    monkeypatch.setattr(decode, "torch_decode_speed", lambda model, **settings: next(torch_speeds))
    monkeypatch.setattr(decode, "generate_torch", lambda model, prompt, tokens: next(samples))
    monkeypatch.setattr(decode, "onnx_decode_speed", lambda paths: [dict(ONNX_BEFORE), dict(ONNX_AFTER)])
    monkeypatch.setattr(decode, "generate_onnx", lambda path, prompt, tokens: [3, 4])
    probe = generation.GenerationProbe.start(nn.Linear(2, 2), tokenizer=None, prompt=[0])
    probe.original_decode = tmp_path / "original.decode.onnx"
    section = probe.finish(nn.Linear(2, 2), tmp_path / "model.decode.onnx")
    assert section["pytorch"]["before"]["tokens_per_s"] == 50.0 and section["pytorch"]["after"]["tokens_per_s"] == 125.0
    assert section["onnxruntime"]["speedup"] == 4.0
    assert (section["before"]["ids"], section["after"]["ids"], section["after_onnx_matches"]) == ([1, 2], [3, 4], True)
    lines = generation.generation_lines(section)
    assert "PyTorch: 50 -> 125 tokens/s (2.50x)" in _line(lines, "PyTorch")
    assert "ONNX Runtime: 100 -> 400 tokens/s (4.00x)" in _line(lines, "ONNX Runtime")
    assert [line for line in lines if line.startswith("greedy")] == ["greedy 20 tokens before: [0] -> [1, 2]",
                                                                      "greedy 20 tokens after: [0] -> [3, 4]"]
    assert next(itertools.chain(torch_speeds, [None])) is None  # both timings were taken, no more
