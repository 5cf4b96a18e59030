"""The perplexity limits of a language model's INT8 files (:mod:`optkit.passes.quantize.tokens`), with perplexities
set by hand (#41).

The FP32 perplexity is 50, far from 1, so a limit of ``ppl * (1 + increase)`` (51 at +2%) and the near miss
``ppl + increase`` (50.02) tell 50.5 apart; and the decode graph's check is given a graph that alone misses its limit
while the main graph passes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from optkit.export import decode
from optkit.kinds.base import ModelInputs
from optkit.passes.quantize import Int8Settings
from optkit.passes.quantize import tokens

BASE = 50.0
#: Vocabulary of the stand-in decode graphs; every token the text feeds is :data:`FED`.
VOCAB, FED = 50, 7
PROMPT, TEXT = [1, 2, 3], [FED] * 8


def _settings(**changes) -> Int8Settings:
    return Int8Settings(**{"mode": "dynamic", "calib_data": "text", "max_perplexity_increase": 0.02, **changes})


class _Kind:
    """A token kind whose files score the perplexity :attr:`perplexities` gives their names."""

    def __init__(self, perplexities: dict[str, float]):
        self.perplexities = perplexities

    def eval_set(self, model, shape, spec, *, split, samples, data):
        ids = torch.arange(2 * shape[1]).reshape(2, shape[1]) % VOCAB
        inputs = ModelInputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                             ("input_ids", "attention_mask"))
        return type("EvalSet", (), {"model_inputs": lambda self: inputs})()

    def eval_outputs(self, path, eval_set, batch_size):
        return Path(path).name

    def score(self, outputs, eval_set, reference=None):
        return {"perplexity": self.perplexities[outputs], "samples": 2, "tokens": 62, "agreement": 1.0}


@pytest.mark.parametrize("perplexity, passes", [(50.5, True), (50.99, True), (51.5, False)])
def test_the_main_files_limit_is_a_fraction_of_fp32s_perplexity(perplexity, passes):
    kind = _Kind({"fp32.onnx": BASE, "int8.onnx": perplexity})
    check = tokens._text_check(Path("fp32.onnx"), None, kind, (1, 32), _settings())
    assert check.base["perplexity"] == BASE
    figures, missed = check.run(Path("int8.onnx"))
    assert figures["perplexity"] == perplexity
    assert (missed == []) is passes, missed
    if not passes:
        assert "+3.00% > +2.00%" in missed[0]


class _DecodeSession:
    """A stand-in decode graph whose next-token distribution is the same at every step: token :data:`FED` has
    probability ``1 / perplexity``, the rest share the remainder (so the perplexity over a text of :data:`FED`
    tokens is ``perplexity``)."""

    def __init__(self, perplexity: float):
        p = 1.0 / perplexity
        self.row = np.zeros(VOCAB, np.float32)
        self.row[FED] = math.log(p * (VOCAB - 1) / (1 - p))

    def get_inputs(self):
        def entry(name, shape):
            return type("Input", (), {"name": name, "shape": shape})()

        return [entry("input_ids", ["batch", "new"]), entry("attention_mask", ["batch", "total"]),
                *(entry(f"past.0.{w}", ["batch", 1, "past", 4]) for w in ("key", "value"))]

    def run(self, outputs, feed):
        new = feed["input_ids"].shape[1]
        present = [np.concatenate([feed[f"past.0.{w}"], np.zeros((1, 1, new, 4), np.float32)], axis=2)
                   for w in ("key", "value")]
        return [np.tile(self.row, (1, new, 1)), *present]


def _decode_sessions(monkeypatch, perplexities: dict[str, float]) -> None:
    monkeypatch.setattr(decode, "session",
                        lambda path, threads=None, **_: _DecodeSession(perplexities[Path(path).name]))


def _check() -> tokens.TokenCheck:
    figures = {"samples": 1, "tokens": 8, "agreement": 1.0, "perplexity": BASE}
    return tokens.TokenCheck("text (val)", dict(figures), lambda path, increase=None: (dict(figures), []),
                             [np.zeros((1, 8), np.int64), np.ones((1, 8), np.int64)], [(PROMPT, TEXT)], True)


@pytest.mark.parametrize("perplexity, passes", [(50.5, True), (51.5, False), (60.0, False)])
def test_the_decode_graphs_limit_is_a_fraction_of_its_fp32_perplexity(monkeypatch, perplexity, passes):
    _decode_sessions(monkeypatch, {"fp32.decode.onnx": BASE, "int8.decode.onnx": perplexity})
    figures, missed = tokens.decode_figures(Path("fp32.decode.onnx"), Path("int8.decode.onnx"), _check(), _settings())
    assert figures["perplexity_fp32"] == pytest.approx(BASE, rel=1e-5)
    assert figures["perplexity_int8"] == pytest.approx(perplexity, rel=1e-5)
    assert (missed == []) is passes, missed


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from optkit.export.onnx import export_onnx

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    folder = tmp_path_factory.mktemp("decode-limit")
    export_onnx(model.eval(), folder / "model.onnx", (1, 16))
    decode.export_decode(model, decode.decode_path(folder / "model.onnx"))
    return model, folder / "model.onnx"


def test_a_decode_graph_that_alone_misses_its_limit_is_refused_while_the_model_passes(exported, tmp_path,
                                                                                       monkeypatch):
    model, fp32 = exported
    # The main graph's check passes (the stand-in check); every INT8 decode graph scores 60 against FP32's 50.
    monkeypatch.setattr(decode, "session", lambda path, threads=None, **_: _DecodeSession(
        BASE if Path(path) == decode.decode_path(fp32) else 60.0))
    result = tokens.quantize_tokens(fp32, tmp_path / "model.int8.onnx", _settings(), model=model, input_shape=(1, 16),
                                    check=_check())
    assert (tmp_path / "model.int8.onnx").is_file() and result.perplexity_int8 == BASE
    assert result.decode["file"] is None and result.decode["perplexity_int8"] == pytest.approx(60.0, rel=1e-5)
    assert result.decode["missed"] and "+20.00% > +2.00%" in result.decode["missed"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.int8.onnx"]
    assert any("was not written: the INT8 decode graph missed its check" in note for note in result.notes)
