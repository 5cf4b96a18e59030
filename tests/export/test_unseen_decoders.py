"""Decoders outside optkit's development set export and verify (#41): Helium, Cohere, Cohere2, Ernie 4.5, GLM-4 and
Apertus, built from small configs with random weights, unpruned and pruned.

What they do that the exporters did not follow, each also checked on a module of a few lines:

* rotary embeddings that interleave their frequencies (``repeat_interleave(2, dim=-1)``): TorchScript's symbolic
  made ``dim`` positive in place on a constant that every other ``-1`` of the graph shares, so
  ``view(batch, seq, -1, head_dim)`` became ``view(batch, seq, rank - 1, head_dim)`` (ONNX Runtime: "input
  {1,16,64}, requested {1,16,2,16}"; GLM-4: "All tensors must have the same rank");
* the xIELU activation's ``expm1``, which TorchScript had no symbolic for;
* the dynamo exporter was given one dynamic-shape entry per input where a kind's export view takes them all as
  ``*tensors`` (one entry), so it failed on every token model.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

transformers = pytest.importorskip("transformers")

from optkit.export import decode  # noqa: E402
from optkit.export.onnx import export_onnx  # noqa: E402
from optkit.passes.prune import StructuredPrune  # noqa: E402

TOKENS = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: hidden 64, 4 query heads of 16 over 2 KV heads (Helium's default head_dim of 128 does not fit its o_proj).
SIZES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128)
TYPES = ("helium", "cohere", "cohere2", "ernie4_5", "glm4", "apertus")
SEQ_LEN = 16


def _decoder(model_type: str) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **TOKENS, **SIZES)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class _InterleavedRotary(nn.Module):
    """The pattern of those rotary embeddings: a ``repeat_interleave(2, dim=-1)`` beside a ``view(..., -1, 16)``."""

    def forward(self, x, positions):
        frequencies = torch.repeat_interleave(positions[..., None].float(), 2, dim=-1)
        heads = x.view(*x.shape[:-1], -1, 16)
        return heads.sum(-1) + frequencies.sum(-1, keepdim=True)


def _export_plain(module: nn.Module, args: tuple, path, names: list[str], opset: int):
    from optkit.export.symbolics import exporter_symbolics

    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    with exporter_symbolics(opset):
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=names, output_names=["out"],
                          dynamic_axes=axes, opset_version=opset)


@pytest.mark.parametrize("opset", [17, 18])
def test_a_view_minus_one_beside_an_interleaved_rotary_keeps_its_meaning(tmp_path, opset):
    module = _InterleavedRotary()
    path = tmp_path / "rotary.onnx"
    _export_plain(module, (torch.randn(1, 5, 64), torch.arange(5)[None]), path, ["x", "positions"], opset)
    x, positions = torch.randn(2, 7, 64), torch.arange(7)[None].repeat(2, 1)
    (actual,) = ort.InferenceSession(str(path)).run(None, {"x": x.numpy(), "positions": positions.numpy()})
    assert actual.shape == (2, 7, 4)  # 64 channels in 4 heads of 16, not 2 (the interleaved tensor's rank - 1)
    np.testing.assert_allclose(actual, module(x, positions).numpy(), rtol=1e-5, atol=1e-5)


def test_expm1_exports_as_exp_minus_one(tmp_path):
    class Activation(nn.Module):
        def forward(self, x):
            return torch.expm1(torch.clamp(x, max=0.5)) * 3

    path = tmp_path / "expm1.onnx"
    _export_plain(Activation(), (torch.randn(1, 5, 8),), path, ["x"], 18)
    x = torch.linspace(-6, 3, 2 * 7 * 8).reshape(2, 7, 8)
    (actual,) = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(actual, Activation()(x).numpy(), rtol=1e-5, atol=1e-6)


def test_the_symbolics_are_registered_only_while_optkit_exports():
    from torch.onnx._internal.torchscript_exporter import registration

    from optkit.export.symbolics import exporter_symbolics

    with exporter_symbolics(18):
        assert registration.registry.get_function_group("aten::expm1").get(18) is not None
    group = registration.registry.get_function_group("aten::expm1")
    assert group is None or group.get(18) is None


class _MaskedTokens(nn.Module):
    """A token model taking ``input_ids`` and ``attention_mask``: its kind exports it through a ``*tensors`` view."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, input_ids, attention_mask):
        return self.head(self.embed(input_ids) * attention_mask[..., None])


def test_the_dynamo_exporter_takes_a_token_models_dynamic_batch_and_sequence(tmp_path):
    torch.manual_seed(0)
    model = _MaskedTokens().eval()
    result = export_onnx(model, tmp_path / "model.onnx", (1, SEQ_LEN), exporter="dynamo")
    assert result.exporter == "dynamo" and [v.batch_size for v in result.verification] == [1, 3]
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    ids = np.random.default_rng(0).integers(3, 256, (2, 9))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    (logits,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        expected = model(torch.from_numpy(ids), torch.from_numpy(mask))
    np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_dynamo_exporter_exports_a_decoder_too(tmp_path):
    model = _decoder("cohere")
    result = export_onnx(model, tmp_path / "model.onnx", (1, SEQ_LEN), exporter="dynamo")
    assert result.exporter == "dynamo" and [v.batch_size for v in result.verification] == [1, 3]
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    ids = np.random.default_rng(0).integers(3, 256, (2, 9))
    (logits,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids), attention_mask=torch.ones(2, 9, dtype=torch.long)).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("model_type", TYPES)
def test_the_decoder_exports_with_the_first_exporter_and_its_decode_step_too(model_type, tmp_path):
    model = _decoder(model_type)
    result = export_onnx(model, tmp_path / "model.onnx", (1, SEQ_LEN))
    assert (result.exporter, result.attempts) == ("torchscript", {})
    assert all(check.passed for check in result.verification)
    written = decode.export_decode(model, tmp_path / "model.decode.onnx")
    assert written.layers == 2 and all(diff <= tol for _, _, diff, tol in written.checks)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_the_pruned_decoder_exports_and_verifies(model_type, tmp_path):
    model = _decoder(model_type)
    before = sum(p.numel() for p in model.parameters())
    StructuredPrune(ratio=0.3, input_shape=(1, SEQ_LEN))(model)
    assert sum(p.numel() for p in model.parameters()) <= 0.9 * before
    result = export_onnx(model, tmp_path / "model.onnx", (1, SEQ_LEN))
    assert (result.exporter, result.attempts) == ("torchscript", {})
    decode.export_decode(model, tmp_path / "model.decode.onnx")
