"""A timing taken under load is retried once, and flagged if still loaded or noisy, never printed as a result (#42).

The load average is a fake (:func:`optkit.analysis.latency.load_average` replaced), so these tests say the same on
a quiet machine and on a busy one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.analysis import generation, latency
from optkit.analysis.latency import Conditions, measured_steadily, timing_flag
from optkit.analysis.report import _rows, onnx_latency_note

QUIET, BUSY = 0.3, 7.5
UNDER_LOAD = "measured twice under load (load average 7.50 on 2 cores): not a result"


@pytest.fixture
def machine(monkeypatch):
    """Two cores and a load average that follows ``machine.loads`` (the last value repeats)."""
    class Machine:
        loads: list[float] = [QUIET]
        reads = 0

        def load_average(self) -> float:
            value = self.loads[min(self.reads, len(self.loads) - 1)]
            self.reads += 1
            return value

    fake = Machine()
    monkeypatch.setattr(latency, "load_average", fake.load_average)
    monkeypatch.setattr(latency, "usable_cores", lambda: 2)
    monkeypatch.setattr(latency, "NOISY_SPREAD", 1.3)
    return fake


def test_a_quiet_timing_is_taken_once(machine):
    calls = itertools.count(1)
    result, conditions = measured_steadily(lambda: next(calls), threads=2, spreads=lambda _: [1.05], retries=1)
    assert result == 1 and conditions.attempts == 1 and conditions.flag() is None


def test_a_timing_under_load_is_retried_once_and_kept_when_the_retry_is_quiet(machine):
    machine.loads = [BUSY, BUSY, QUIET, QUIET]
    calls = itertools.count(1)
    result, conditions = measured_steadily(lambda: next(calls), threads=2, spreads=lambda _: [1.05], retries=1)
    assert result == 2 and conditions.attempts == 2 and conditions.flag() is None


def test_a_timing_still_under_load_after_its_retry_is_flagged(machine):
    machine.loads = [BUSY]
    calls = itertools.count(1)
    result, conditions = measured_steadily(lambda: next(calls), threads=2, spreads=lambda _: [1.05], retries=1)
    assert result == 2 and conditions.attempts == 2
    assert conditions.flag() == UNDER_LOAD


def test_the_load_limit_is_the_cores_the_timing_uses_plus_a_margin(machine):
    # 2.9 on 2 cores: this process's own threads and the background; 3.1: other work competes.
    assert not Conditions(2.9, 2.9, 2).loaded and Conditions(3.1, 0.2, 2).loaded
    # A one-thread timing on a 2-core machine counts 1 core.
    machine.loads = [2.5]
    _, conditions = measured_steadily(lambda: None, threads=1, spreads=lambda _: [], retries=0)
    assert conditions.cores == 1 and conditions.loaded
    assert "(load average 2.50 on 1 core)" in conditions.flag()


def test_a_large_spread_of_one_side_of_an_interleaved_timing_is_retried_then_flagged(machine):
    spreads = iter([[1.02, 1.6], [1.03, 1.5]])
    _, conditions = measured_steadily(lambda: next(spreads), threads=2, spreads=lambda s: s, retries=1)
    assert conditions.attempts == 2 and not conditions.loaded and conditions.noisy
    assert conditions.flag().startswith("measured twice with p90 / median up to 1.50") and "not a result" in conditions.flag()


def test_bench_torch_records_conditions_and_flags_a_loaded_timing(machine):
    machine.loads = [BUSY]
    torch.set_num_threads(2)
    (timed,) = latency.bench_torch(nn.Linear(4, 4), (1, 4), warmup=0, repeats=3, retries=1)
    assert timed.conditions.attempts == 2 and timed.flag() == UNDER_LOAD
    assert timed.to_dict()["conditions"]["load_before"] == BUSY


def _onnx_timing(load: float, speedup: float = 1.5) -> dict:
    conditions = Conditions(load, load, 2, (1.05, 1.04), 2).to_dict()
    side = {"median_ms": 3.0, "conditions": conditions}
    return {"threads": 2, "before": side, "after": {**side, "median_ms": 3.0 / speedup}, "speedup": speedup,
            "ideal_speedup": 2.0, "efficiency": speedup / 2, "load_avg_1min": load}


def test_the_report_says_an_onnx_timing_under_load_is_not_a_result():
    line = onnx_latency_note(_onnx_timing(BUSY))
    assert UNDER_LOAD in line and "faster" not in line and "efficiency" not in line
    assert "faster" in onnx_latency_note(_onnx_timing(QUIET))
    report = {"before": {"params": 1, "macs": 1, "sparsity": 0.0}, "after": {"params": 1, "macs": 1, "sparsity": 0.0},
              "onnx_latency": _onnx_timing(BUSY)}
    (row,) = [row for row in _rows(report) if row[0].startswith("ONNX Runtime ms")]
    assert row[3] == "not a result (load)"


def test_the_decode_line_of_a_loaded_timing_gives_no_speed_up():
    """The issue's line: "PyTorch: 271 -> 21 tokens/s (0.08x)", measured while another process loaded the machine."""
    loaded = Conditions(1.2, BUSY, 2, (1.1,), 2).to_dict()
    quiet = Conditions(0.4, 0.5, 2, (1.05,), 1).to_dict()
    before = {"median_ms": 3.69, "tokens_per_s": 271.0, "threads": 2, "conditions": quiet}
    after = {"median_ms": 47.6, "tokens_per_s": 21.0, "threads": 2, "conditions": loaded}
    section = {"decode_prompt_tokens": 8, "pytorch": generation._pair(before, after), "prompt": "a", "prompt_ids": [0],
               "sample_tokens": 2, "before": {"text": "a b", "ids": [1]}, "after": {"text": "a c", "ids": [2]},
               "notes": []}
    (line,) = [line for line in generation.generation_lines(section) if "PyTorch" in line]
    assert UNDER_LOAD in line and "271 -> 21 tokens/s" in line and "0.08x" not in line
    assert timing_flag(before) is None


def test_the_generation_probe_retries_pytorch_decode_timed_under_load(machine, monkeypatch):
    from optkit.export import decode

    machine.loads = [BUSY, BUSY, QUIET, QUIET]
    speeds = iter([{"median_ms": 40.0, "p90_ms": 44.0, "tokens_per_s": 25.0, "threads": 2},
                   {"median_ms": 4.0, "p90_ms": 4.2, "tokens_per_s": 250.0, "threads": 2}])
    monkeypatch.setattr(decode, "torch_decode_speed", lambda model, **settings: next(speeds))
    monkeypatch.setattr(decode, "generate_torch", lambda model, prompt, tokens: [1, 2])
    measured = generation._measure(nn.Linear(2, 2), [0])
    assert measured["speed"]["tokens_per_s"] == 250.0 and measured["speed"]["conditions"]["attempts"] == 2
    assert timing_flag(measured["speed"]) is None


def test_bench_cli_flags_timings_under_load(machine, tmp_path):
    from optkit.cli import main

    machine.loads = [BUSY]
    result = CliRunner().invoke(main, ["bench", "torchvision:squeezenet1_1", "--num-classes", "10", "--input-shape",
                                       "1,3,32,32", "--threads", "2", "--warmup", "0", "--repeats", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "not a result" in " ".join(result.output.split())


def test_the_int8_timing_note_flags_a_timing_under_load(monkeypatch):
    from optkit.passes.quantize import latency as int8_latency

    loaded = Conditions(BUSY, BUSY, 2, (1.05, 1.05), 2)

    def fake(paths, shape, **_):
        return [latency.Latency("onnxruntime", "cpu", shape[0], tuple(shape), 2, ms, ms, ms, ms, 1.0, 20, 3, 1.0,
                                conditions=loaded) for ms in (2.0, 1.0)]

    monkeypatch.setattr(int8_latency, "interleaved_latency", fake)
    (run,) = int8_latency.compare_latency("a.onnx", "b.onnx", (1, 3, 8, 8), threads=(2,))["runs"]
    assert run["not_a_result"] == UNDER_LOAD
