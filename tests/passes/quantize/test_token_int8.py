"""INT8 of a language model: dynamic quantization of model.onnx and its decode graph, verified by perplexity on text.

The model is a tiny Llama trained for a few seconds on patterned text (each word is followed by the next one in a
fixed list), so its predictions are confident and INT8 has a real task to keep. Timing is replaced by fixed figures:
what is checked here is what was written and how it was verified.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from optkit.cli import main
from optkit.core.errors import DataError, ExportError
from optkit.core.forms import OnnxModel
from optkit.export import decode
from optkit.export.onnx import export_onnx
from optkit.passes.quantize import Int8Settings
from optkit.passes.quantize.passes import Int8, decode_int8_path, quantize_exported
from tests.support.trained_lm import trained_lm

LENGTH = 32
SHAPE = (1, LENGTH)
#: A weight this large sets every INT8 scale of its layer so coarse that the layer's ordinary weights round to zero.
OUTLIER = 1000.0
#: The decode speeds the stand-in timer reports, FP32 then INT8.
DECODE_MS = (2.0, 1.6)


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path]:
    """A trained tiny Llama ``save_pretrained`` folder with its tokenizer, and the folder of text it learned."""
    return trained_lm(tmp_path_factory.mktemp("token-int8"), LENGTH)


def _load(folder: Path, *, sensitive: bool = False):
    """The trained model; ``sensitive``: layer 1's MLP output projection made hypersensitive to INT8.

    Its up projection gets a dead channel (zero weights: exactly 0 in FP32), which the down projection then weighs by
    :data:`OUTLIER`: nothing changes in FP32, but in INT8 every other weight of the down projection rounds to zero.
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder)).eval()
    if sensitive:
        mlp = model.model.layers[1].mlp
        with torch.no_grad():
            mlp.up_proj.weight[-1].zero_()
            mlp.down_proj.weight[:, -1] = OUTLIER
    return model


@pytest.fixture(scope="module")
def exported(lm, tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """``{name: (model, model.onnx)}`` with ``model.decode.onnx`` beside each file: ``plain`` and ``sensitive``."""
    files = {}
    for name in ("plain", "sensitive"):
        model = _load(lm[0], sensitive=name == "sensitive")
        path = tmp_path_factory.mktemp(name) / "model.onnx"
        export_onnx(model, path, SHAPE)
        decode.export_decode(model, decode.decode_path(path))
        files[name] = (model, path)
    return files


@pytest.fixture
def no_timing(monkeypatch):
    """Fixed figures instead of ONNX Runtime timings (the timing functions have tests of their own)."""
    def latency(fp32_path, int8_path, input_shape, **kwargs):
        timed = {"median_ms": 1.0}
        return {"load_avg_1min": [0.0, 0.0], "runs": [{"batch_size": 1, "threads": 2, "fp32": timed, "int8": timed,
                                                        "speedup": 1.0, "noisy": False}]}

    def speed(paths, **kwargs):
        return [{"median_ms": ms, "p90_ms": ms, "tokens_per_s": round(1e3 / ms, 1), "steps": 1, "threads": 2}
                for ms in DECODE_MS]

    monkeypatch.setattr("optkit.passes.quantize.latency.compare_latency", latency)
    monkeypatch.setattr("optkit.export.decode.onnx_decode_speed", speed)


def _settings(corpus: Path, **changes) -> Int8Settings:
    return Int8Settings(**{"calib_data": f"text:{corpus}", **changes})


def _perplexity(path: Path, ids: np.ndarray, mask: np.ndarray) -> float:
    """exp(mean next-token NLL) over the positions with a next token, in a fresh default ONNX Runtime session."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input_ids": ids, "attention_mask": mask})[0][:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, ids[:, 1:, None], -1)[..., 0]
    return math.exp(-float(picked[mask[:, 1:] == 1].mean()))


def test_a_language_model_is_quantized_dynamically_and_its_perplexity_is_what_onnx_runtime_gives(lm, exported,
                                                                                                   tmp_path, no_timing):
    from optkit.data.text import token_blocks

    folder, corpus = lm
    model, fp32 = exported["plain"]
    work = tmp_path / "run"
    work.mkdir()
    for path in (fp32, decode.decode_path(fp32)):
        shutil.copy(path, work / path.name)
    result = Int8(calib_data=f"text:{corpus}").apply(OnnxModel(work / "model.onnx", SHAPE, model))
    details = result.details
    assert result.model.path == work / "model.int8.onnx" and result.model.precision == "int8"
    assert sorted(p.name for p in work.iterdir()) == ["model.decode.int8.onnx", "model.decode.onnx",
                                                      "model.int8.onnx", "model.onnx"]
    assert details["files"] == {name: (work / name).stat().st_size for name in ("model.int8.onnx",
                                                                                "model.decode.int8.onnx")}
    assert details["mode"] == "dynamic" and details["path"] == "model.int8.onnx"
    assert details["file_size"] == details["int8_size"] < details["fp32_size"]

    blocks = token_blocks(str(corpus), "val", folder, LENGTH, vocab_size=300, max_positions=64)
    ids, mask = blocks.input_ids.numpy(), blocks.attention_mask.numpy()
    assert details["samples"] == len(ids) and details["tokens"] == int(mask[:, 1:].sum())
    assert details["perplexity_fp32"] == pytest.approx(_perplexity(work / "model.onnx", ids, mask), rel=1e-3)
    assert details["perplexity_int8"] == pytest.approx(_perplexity(work / "model.int8.onnx", ids, mask), rel=1e-3)
    assert details["perplexity_int8"] <= details["perplexity_fp32"] * 1.02
    assert details["perplexity_fp32"] < 3.0  # the model learned the text: INT8 had something to lose
    assert 0.9 <= details["agreement"] <= 1.0 and details["mean_kl"] >= 0
    assert details["accuracy_fp32"] > 0.5 and details["accuracy_int8"] is not None

    info = details["decode"]
    assert info["file"] == "model.decode.int8.onnx" and info["missed"] == []
    assert info["perplexity_int8"] <= info["perplexity_fp32"] * 1.02
    assert info["speedup"] == pytest.approx(DECODE_MS[0] / DECODE_MS[1], rel=1e-3)
    assert info["fp32_tokens_per_s"] == 500.0 and info["int8_tokens_per_s"] == 625.0
    for sample in info["greedy"]:
        steps = len(sample["fp32"])
        assert sample["fp32"] == decode.generate_onnx(work / "model.decode.onnx", sample["prompt"], steps)
        assert sample["int8"] == decode.generate_onnx(work / "model.decode.int8.onnx", sample["prompt"], steps)
    same = sum(a == b for g in info["greedy"] for a, b in zip(g["fp32"], g["int8"]))
    assert info["greedy_match"] == same / sum(len(g["fp32"]) for g in info["greedy"]) >= 0.9

    summary = details["notes"][0]
    assert "\n" not in summary and summary.startswith("model.int8.onnx: dynamic INT8")
    assert "perplexity" in summary and "decode 500 -> 625 tokens/s (1.25x), under 1.5x" in summary
    assert f"model.decode.int8.onnx ({info['size']:,} bytes)" in summary
    assert any("quantized dynamically" in note for note in details["notes"])


def test_a_perplexity_limit_that_cannot_be_met_writes_nothing(lm, exported, tmp_path, no_timing):
    model, fp32 = exported["sensitive"]
    out = tmp_path / "out"
    out.mkdir()
    settings = _settings(lm[1], max_perplexity_increase=0.0, auto_exclude=False)
    with pytest.raises(ExportError, match=r"perplexity [\d.]+ vs [\d.]+ FP32") as error:
        quantize_exported(fp32, out / "model.int8.onnx", settings, SHAPE, model)
    assert "\n" not in str(error.value) and "nothing was written" in str(error.value)
    assert list(out.iterdir()) == []


def test_the_exclusion_search_keeps_the_hypersensitive_matmul_in_fp32_in_both_graphs(lm, exported, tmp_path,
                                                                                     no_timing):
    model, fp32 = exported["sensitive"]
    out = tmp_path / "out"
    out.mkdir()
    details = quantize_exported(fp32, out / "model.int8.onnx", _settings(lm[1]), SHAPE, model)
    assert details["excluded_nodes"] == ["/model/model/layers.1/mlp/down_proj/MatMul"]
    assert details["search"][0]["perplexity"] == details["perplexity_int8"]
    assert details["perplexity_int8"] <= details["perplexity_fp32"] * 1.02
    info = details["decode"]
    assert len(info["excluded_nodes"]) == 1 and "layers.1/mlp/down_proj" in info["excluded_nodes"][0]
    assert info["file"] == "model.decode.int8.onnx" and (out / info["file"]).is_file()


def test_without_text_a_language_model_is_refused_in_one_line(exported, tmp_path):
    model, fp32 = exported["plain"]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match="--calib-data text") as error:
        quantize_exported(fp32, out / "model.int8.onnx", Int8Settings(), SHAPE, model)
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="holds images"):
        quantize_exported(fp32, out / "model.int8.onnx", Int8Settings(calib_data="synthetic:8:3x8x8:2"), SHAPE, model)
    assert list(out.iterdir()) == []


def test_random_calibration_checks_agreement_only_and_says_the_model_is_for_timing(exported, tmp_path, no_timing):
    model, fp32 = exported["plain"]
    out = tmp_path / "out"
    out.mkdir()
    settings = Int8Settings(random_calibration=True, min_agreement=0.8)
    details = quantize_exported(fp32, out / "model.int8.onnx", settings, SHAPE, model)
    assert details["checked_on"] == "random token ids" and details["perplexity_int8"] is None
    assert details["agreement"] >= 0.8 and details["relative_error"] is not None
    assert "fit for timing only" in details["notes"][0]
    assert details["decode"]["agreement"] >= 0.8 and "perplexity_int8" not in details["decode"]
    assert (out / "model.decode.int8.onnx").is_file()


def test_decode_int8_path_sits_beside_the_fp32_file():
    assert decode_int8_path("out/model.onnx") == Path("out/model.decode.int8.onnx")


def test_optimize_int8_of_a_language_model_takes_the_perplexity_limit(lm, tmp_path, no_timing):
    folder, corpus = lm
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", str(folder), "--seq-len", str(LENGTH), "--export", "onnx",
                                       "--int8", "--calib-data", f"text:{corpus}", "--max-perplexity-increase",
                                       "0.05", "--no-latency", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    section = report["int8"]
    assert section["perplexity_int8"] <= section["perplexity_fp32"] * 1.05
    assert "limit +5.00%" in section["notes"][0]
    for name in ("model.int8.onnx", "model.decode.int8.onnx"):
        assert report["files"][name] == (out / name).stat().st_size
    assert section["decode"]["file"] == "model.decode.int8.onnx"
    assert "max_perplexity_increase = 0.05" in (out / "recipe.toml").read_text()


def test_export_int8_of_a_language_model_takes_the_perplexity_limit(lm, tmp_path, no_timing):
    folder, corpus = lm
    target = tmp_path / "model.onnx"
    result = CliRunner().invoke(main, ["export", str(folder), "--onnx", str(target), "--input-shape", f"1,{LENGTH}", "--int8",
                                       "--calib-data", f"text:{corpus}", "--max-perplexity-increase", "0.05"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.decode.int8.onnx", "model.decode.onnx",
                                                          "model.int8.onnx", "model.onnx"]
    assert "Wrote model.int8.onnx beside it" in result.output and "limit +5.00%" in result.output
