"""choose_deployment: every candidate checked, timed against the baseline, the fastest verified one written alone, and
a candidate that measures slower than a simpler one refused with the figures (timings are set, never measured)."""

from __future__ import annotations

import sys

import pytest

from optkit.core.errors import ExportError
from optkit.passes.deploy import DeploySettings, choose_deployment, pick
from optkit.passes.deploy.choose import Candidate
from optkit.runtime import openvino as ov

SHAPE = (1, 1, 28, 28)
BASELINE = ("onnxruntime", None)


def _timed(times: dict[str, float]) -> list[Candidate]:
    candidates = []
    for name, ms in times.items():
        runtime, precision = name.split("-")
        candidates.append(Candidate(name, runtime, precision, latency={"median_ms": ms}))
    return candidates


def test_pick_takes_the_fastest_and_refuses_int8_slower_than_bf16():
    candidates = _timed({"onnxruntime-fp32": 10.0, "openvino-fp32": 9.0, "openvino-bf16": 5.0,
                         "onnxruntime-int8": 6.0, "openvino-int8": 5.5})
    chosen = pick(candidates, min_gain=0.02)
    assert chosen.name == "openvino-bf16" and chosen.status == "chosen" and chosen.reason is None
    by_name = {c.name: c for c in candidates}
    assert by_name["onnxruntime-int8"].status == "refused"
    assert by_name["onnxruntime-int8"].reason == "slower than openvino-bf16 (6.00 ms against 5.00)"
    assert by_name["openvino-int8"].reason == "slower than openvino-bf16 (5.50 ms against 5.00)"
    assert by_name["openvino-fp32"].status == "verified" and "openvino-bf16 measured faster" in by_name[
        "openvino-fp32"].reason


def test_pick_keeps_the_simpler_deployment_unless_the_gain_is_at_least_min_gain():
    candidates = _timed({"onnxruntime-fp32": 10.0, "openvino-fp32": 9.85, "onnxruntime-int8": 9.0})
    chosen = pick(candidates, min_gain=0.02)
    assert chosen.name == "onnxruntime-int8"
    assert candidates[1].reason == "not 2% faster than onnxruntime-fp32 (9.85 ms against 10.00)"
    assert pick(_timed({"onnxruntime-fp32": 10.0, "openvino-fp32": 9.85}), min_gain=0.0).name == "openvino-fp32"


@pytest.mark.parametrize("times", [(10.0, 4.0, 9.0, 8.0, 3.0), (3.0, 4.0, 5.0, 2.9, 2.0), (5.0, 5.0, 5.0, 5.0, 5.0)])
def test_the_choice_is_never_slower_than_a_simpler_verified_one(times):
    names = ("onnxruntime-fp32", "openvino-fp32", "openvino-bf16", "onnxruntime-int8", "openvino-int8")
    candidates = _timed(dict(zip(names, times)))
    chosen = pick(candidates, min_gain=0.02)
    simpler = candidates[:candidates.index(chosen)]
    assert all(chosen.latency["median_ms"] < c.latency["median_ms"] for c in simpler)
    assert all(chosen.latency["median_ms"] <= 1.02 * c.latency["median_ms"] for c in candidates)


@pytest.mark.skipif(not ov.cpu_has_bf16(), reason="this CPU has no bf16 instructions")
def test_only_the_chosen_deployment_is_written_and_every_candidate_is_listed(onnx_copy, fashion_data, set_times):
    calls = set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 8.0, ("openvino", "fp32"): 7.9,
                       ("openvino", "bf16"): 4.0, ("onnxruntime", "int8"): 4.5, ("openvino", "int8"): 4.2})
    settings = DeploySettings(calib_data=fashion_data, min_agreement=0.97, threads=2, batch=1)
    result = choose_deployment(onnx_copy, settings, input_shape=SHAPE)
    assert (result.runtime, result.precision, result.path) == ("openvino", "bf16", "model.xml")
    assert sorted(p.name for p in onnx_copy.parent.iterdir()) == ["model.bin", "model.onnx", "model.xml"]
    assert ov.recorded_precision(ov.read(onnx_copy.with_suffix(".xml"))) == "bf16"
    assert result.speedup == 2.5 and result.compute == "bf16" and (result.threads, result.batch_size) == (2, 1)
    by_name = {c["name"]: c for c in result.candidates}
    assert list(by_name) == ["onnxruntime-fp32", "openvino-fp32", "openvino-bf16", "onnxruntime-int8",
                             "openvino-int8"]
    assert by_name["onnxruntime-int8"]["status"] == "refused" and by_name["onnxruntime-int8"]["speedup"] == 2.222
    assert by_name["openvino-int8"]["reason"] == "slower than openvino-bf16 (4.20 ms against 4.00)"
    assert by_name["openvino-int8"]["check"]["agreement"] >= 0.97
    assert result.notes[0].startswith("deployment: OpenVINO bf16, compiled with INFERENCE_PRECISION_HINT bf16")
    assert any("ONNX Runtime INT8: 4.50 ms (2.22x); refused: slower than openvino-bf16" in n for n in result.notes)
    assert [(t.runtime, t.precision) for t, _ in calls[-1]] == [BASELINE, ("onnxruntime", "fp32"), ("openvino", "fp32"),
                                                          ("openvino", "bf16"), ("onnxruntime", "int8"),
                                                          ("openvino", "int8")]


def test_on_a_cpu_without_bf16_the_fastest_other_deployment_is_written(onnx_copy, fashion_data, set_times,
                                                                       monkeypatch):
    monkeypatch.setattr(ov, "cpu_has_bf16", lambda: False)
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 8.0, ("openvino", "fp32"): 7.9,
               ("openvino", "bf16"): 1.0, ("onnxruntime", "int8"): 4.5, ("openvino", "int8"): 4.2})
    settings = DeploySettings(calib_data=fashion_data, min_agreement=0.97, threads=2, batch=1)
    result = choose_deployment(onnx_copy, settings, input_shape=SHAPE)
    assert (result.runtime, result.precision, result.path) == ("openvino", "int8", "model.xml")
    assert sorted(p.name for p in onnx_copy.parent.iterdir()) == ["model.bin", "model.onnx", "model.xml"]
    by_name = {c["name"]: c for c in result.candidates}
    assert by_name["openvino-bf16"]["status"] == "unavailable" and "no bf16" in by_name["openvino-bf16"]["reason"]
    assert by_name["onnxruntime-int8"]["reason"] == "openvino-int8 measured faster (4.20 ms against 4.50)"


@pytest.mark.skipif(not ov.cpu_has_bf16(), reason="this CPU has no bf16 instructions")
def test_a_candidate_that_misses_its_check_is_listed_with_why(offset_onnx, fashion_data, set_times):
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0, ("openvino", "bf16"): 2.0})
    settings = DeploySettings(calib_data=fashion_data, candidates=("onnxruntime-fp32", "openvino-bf16"),
                              eval_samples=64)
    result = choose_deployment(offset_onnx, settings, input_shape=SHAPE)
    assert (result.runtime, result.precision, result.path) == ("onnxruntime", "fp32", "model.onnx")
    assert sorted(p.name for p in offset_onnx.parent.iterdir()) == ["model.onnx"]
    (bf16,) = [c for c in result.candidates if c["name"] == "openvino-bf16"]
    assert bf16["status"] == "refused" and bf16["latency"] is None
    assert bf16["reason"].startswith("OpenVINO bf16 missed the check on fashion-mnist (val): top-1 agreement")


def test_without_data_lower_precisions_are_refused_and_fp32_is_kept(onnx_copy, set_times):
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0, ("openvino", "fp32"): 12.0})
    result = choose_deployment(onnx_copy, DeploySettings(), input_shape=SHAPE)
    assert (result.runtime, result.precision, result.path) == ("onnxruntime", "fp32", "model.onnx")
    assert sorted(p.name for p in onnx_copy.parent.iterdir()) == ["model.onnx"]
    reasons = {c["name"]: c["reason"] for c in result.candidates}
    assert "--calib-data" in reasons["onnxruntime-int8"] and "--calib-data" in reasons["openvino-int8"]
    assert reasons["openvino-fp32"] == "slower than onnxruntime-fp32 (12.00 ms against 10.00)"


def test_without_openvino_the_onnx_runtime_candidates_run_and_a_note_says_what_it_adds(onnx_copy, set_times,
                                                                                      monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0, ("onnxruntime", "int8"): 12.0})
    result = choose_deployment(onnx_copy, DeploySettings(random_calibration=True, min_agreement=0.0),
                               input_shape=SHAPE)
    statuses = {c["name"]: c["status"] for c in result.candidates}
    assert statuses == {"onnxruntime-fp32": "chosen", "openvino-fp32": "unavailable", "openvino-bf16": "unavailable",
                        "onnxruntime-int8": "refused", "openvino-int8": "unavailable"}
    assert result.notes[-1] == ov.MISSING_NOTE


def test_a_candidate_whose_runtime_cannot_take_the_model_is_refused_and_the_others_still_run(onnx_copy, set_times,
                                                                                           monkeypatch):
    from optkit.core.errors import OptkitError
    from optkit.passes import quantize

    def cannot_load(*args, **kwargs):
        raise OptkitError("probe.onnx: ONNX Runtime cannot load it (Type Error: tensor(float) against tensor(int64))")

    monkeypatch.setattr(quantize, "quantize_onnx", cannot_load)
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0, ("openvino", "fp32"): 8.0})
    result = choose_deployment(onnx_copy, DeploySettings(random_calibration=True, min_agreement=0.0),
                               input_shape=SHAPE)
    (int8,) = [c for c in result.candidates if c["name"] == "onnxruntime-int8"]
    assert int8["status"] == "refused" and int8["reason"].startswith("probe.onnx: ONNX Runtime cannot load it")
    statuses = {c["name"]: c["status"] for c in result.candidates}
    chosen = f"{result.runtime}-{result.precision}"
    assert list(statuses.values()).count("chosen") == 1 and statuses[chosen] == "chosen"
    assert statuses["onnxruntime-int8"] == "refused"


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ExportError, match="missing.onnx not found; export the model first"):
        choose_deployment(tmp_path / "missing.onnx", DeploySettings(), input_shape=SHAPE)


def _token_model_onnx(path):
    """A two-input (token ids, attention mask) ONNX file, as a token model's export writes."""
    import torch
    from torch import nn

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

        def forward(self, input_ids, attention_mask):
            return self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1).float())

    torch.manual_seed(0)
    ids = torch.ones(1, 8, dtype=torch.long)
    torch.onnx.export(Tokens().eval(), (ids, ids), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["logits"], dynamo=False)
    return path


def test_openvino_takes_a_model_of_token_ids_and_a_mask(tmp_path, set_times):
    """A two-input file (token ids and a mask) converts to OpenVINO and is checked against ONNX Runtime on example
    inputs for both inputs; a faster OpenVINO fp32 is then chosen."""
    pytest.importorskip("openvino")
    source = _token_model_onnx(tmp_path / "model.onnx")
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0, ("openvino", "fp32"): 8.0})
    settings = DeploySettings(candidates=("onnxruntime-fp32", "openvino-fp32"), threads=1, batch=1)

    result = choose_deployment(source, settings, input_shape=(1, 8))

    assert (result.runtime, result.precision, result.path) == ("openvino", "fp32", "model.xml")
    check = {c["name"]: c for c in result.candidates}["openvino-fp32"]["check"]
    assert check["agreement"] == 1.0 and check["checked_on"] == "random"
    assert [p.get_any_name() for p in ov.read(tmp_path / "model.xml").inputs] == ["input_ids", "attention_mask"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "model.onnx", "model.xml"]


def test_lower_openvino_precisions_of_a_two_input_model_need_random_calibration(tmp_path):
    """Image data cannot feed token ids and a mask: bf16/INT8 of such a file are refused in one line naming the
    inputs, and checked on example inputs with --random-calibration."""
    pytest.importorskip("openvino")
    from optkit.core.errors import DataError
    from optkit.passes.deploy import openvino_ir

    source = _token_model_onnx(tmp_path / "model.onnx")
    with pytest.raises(DataError, match=r"^model.onnx takes 2 inputs \(input_ids, attention_mask\): OpenVINO int8 "):
        openvino_ir(source, tmp_path / "model.xml", "int8", DeploySettings(calib_data="fashion-mnist"),
                    input_shape=(1, 8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    result = openvino_ir(source, tmp_path / "model.xml", "int8", DeploySettings(random_calibration=True,
                                                                                min_agreement=0.0),
                         input_shape=(1, 8))
    assert result.checked_on == "random" and result.samples == 2 and (tmp_path / "model.bin").is_file()


def test_a_weight_only_candidate_named_for_an_image_model_is_listed_as_unavailable(onnx_copy, set_times):
    set_times({BASELINE: 10.0, ("onnxruntime", "fp32"): 10.0})
    settings = DeploySettings(candidates="onnxruntime-w4,onnxruntime-fp32", threads=1)
    assert settings.candidates == ("onnxruntime-fp32", "onnxruntime-w4")
    result = choose_deployment(onnx_copy, settings, input_shape=SHAPE)
    w4 = {c["name"]: c for c in result.candidates}["onnxruntime-w4"]
    assert (w4["status"], w4["reason"]) == ("unavailable", "onnxruntime-w4 is for language models (weight-only "
                                                           "quantization)")
    with pytest.raises(ValueError, match="deployment candidates must be names among onnxruntime-fp32, .*openvino-w4"):
        DeploySettings(candidates="onnxruntime-int2")
