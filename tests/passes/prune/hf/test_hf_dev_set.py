"""Issue #29's acceptance on its development set, through the CLI: every type's tiny ``save_pretrained`` folder
(``benchmarks/_hf_configs.py``) goes through ``optkit optimize DIR --prune 0.3 --export onnx``; the stock class
loads OUT with no missing or unexpected keys and gives the pruned model's logits, parameters are at most 0.8×
with heads and MLP width both reduced, ``OUT/model.onnx`` matches in ONNX Runtime, and decoders generate.

Slow (about half a minute a type); ``benchmarks/hf_zoo.py`` measures the same path and records the figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from benchmarks._hf_configs import (  # noqa: E402
    AUTO_CLASS, DECODERS, DEV_SET, IMAGE_SIZE, VOCAB, build, is_image, shape_of)
from optkit.cli import main  # noqa: E402
from optkit.io.models import load_model  # noqa: E402

SEQ_LEN = 16


def _inputs(model_type: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if is_image(model_type):
        return {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)}
    ids = torch.randint(3, VOCAB, (2, SEQ_LEN), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", DEV_SET)
def test_optimize_prunes_the_type_and_the_stock_class_reloads_it(model_type, tmp_path):
    import numpy as np
    import onnxruntime as ort

    original = build(model_type)
    original.save_pretrained(tmp_path / "in")
    out = tmp_path / "out"
    shape = ["--input-shape", f"1,3,{IMAGE_SIZE},{IMAGE_SIZE}"] if is_image(model_type) else ["--seq-len", str(SEQ_LEN)]
    result = CliRunner().invoke(main, ["optimize", str(tmp_path / "in"), "--prune", "0.3", "--export", "onnx",
                                       "--no-latency", "--save-pt", *shape, "--out", str(out)])
    assert result.exit_code == 0, result.output

    stock, info = getattr(transformers, AUTO_CLASS[model_type]).from_pretrained(out, output_loading_info=True)
    assert type(stock) is type(original)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    pruned = load_model(out / "model.pt").eval()
    inputs = _inputs(model_type)
    with torch.no_grad():
        expected = pruned(**inputs).logits
        torch.testing.assert_close(stock.eval()(**inputs).logits, expected, atol=1e-5, rtol=0)

    params = sum(p.numel() for p in stock.parameters()) / sum(p.numel() for p in original.parameters())
    assert params <= 0.8
    before, after = shape_of(original.config), shape_of(stock.config)
    assert after["heads"] != before["heads"] and after["intermediate"] != before["intermediate"], (before, after)

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feed = ({names[0]: next(iter(inputs.values())).numpy()} if len(names) == 1 and len(inputs) == 1
            else {name: inputs[name].numpy() for name in names})  # an image model's one input is named "input"
    (actual, *_) = session.run(None, feed)
    np.testing.assert_allclose(actual, expected.numpy(), atol=1e-4 * float(expected.abs().max()), rtol=0)
    if model_type in DECODERS:
        prompt = inputs["input_ids"][:1, :4]
        assert stock.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False).shape == (1, 12)
