"""The decode-step graph honours its attention mask: a left-padded batch gets the logits PyTorch gives it (#41).

The export's own check compares the graph with the step it was traced from, so a step that ignored padding would
pass it; here the reference is the model itself, called on the whole padded sequence, and the padded row is chosen
so that its logits with padding differ from those without.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from optkit.export import decode

VOCAB = 97
KV_HEADS, HEAD_DIM, LAYERS = 2, 8, 2


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=6, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's: the pad tokens change the padded row's logits visibly
        for p in model.parameters():
            p.mul_(8.0)
    return model


def _close(actual: np.ndarray, expected: torch.Tensor) -> bool:
    return bool(np.abs(actual - expected.numpy()).max() <= 1e-3 * float(expected.abs().max()))


def test_a_left_padded_batch_gets_pytorchs_logits_on_prefill_and_on_each_decode_step(tmp_path):
    model = _llama()
    path = tmp_path / "model.decode.onnx"
    decode.export_decode(model, path)
    session = ort.InferenceSession(str(path))
    ids = torch.tensor([[5, 17, 3, 40, 2, 9], [61, 29, 11, 23, 7, 31]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # row 1: two pad tokens on the left
    empty = [np.zeros((2, KV_HEADS, 0, HEAD_DIM), np.float32)] * (2 * LAYERS)
    logits, *cache = session.run(None, decode.feed(session, [ids.numpy(), mask.numpy(), *empty]))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        unpadded = model(input_ids=ids, attention_mask=torch.ones_like(mask)).logits[:, -1]
    assert not _close(expected[1].numpy(), unpadded[1])  # the mask matters for the padded row
    assert _close(logits[:, -1], expected)

    for step, new in enumerate(([[44], [8]], [[13], [70]])):
        new_ids = torch.tensor(new)
        ids, mask = torch.cat([ids, new_ids], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        logits, *cache = session.run(None, decode.feed(session, [new_ids.numpy(), mask.numpy(), *cache]))
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        assert _close(logits[:, -1], expected), f"decode step {step + 1}"
