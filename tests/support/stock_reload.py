"""Tiny ``transformers`` Swin models, their attention units, and the check that a pruned image model's stock class
loads it back unchanged."""

from __future__ import annotations

import torch

IMAGE = 32


def pixels() -> torch.Tensor:
    """A fixed batch of two 32x32 RGB images."""
    return torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))


def assert_stock_class_reloads(pruned, stock_class, folder, inputs: dict | None = None, atol: float = 1e-5) -> None:
    """``save_pretrained`` then ``stock_class.from_pretrained``: no missing, unexpected or mis-shaped keys, and the
    reload's logits equal the pruned model's to ``atol`` on ``inputs`` (default: :func:`pixels`)."""
    pruned.save_pretrained(folder)
    stock, info = stock_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    inputs = inputs if inputs is not None else {"pixel_values": pixels()}
    with torch.no_grad():
        torch.testing.assert_close(stock.eval()(**inputs).logits, pruned(**inputs).logits, atol=atol, rtol=0)


def tiny_swin(config_class=None, model_class=None):
    """A 2-stage Swin (embed 32, heads [2, 4] of 16, 32x32 images) in eval mode, bias tables made non-zero so that
    a wrongly kept head shows in the outputs; SwinV2 with its classes."""
    import transformers

    config_class = config_class or transformers.SwinConfig
    model_class = model_class or transformers.SwinForImageClassification
    torch.manual_seed(0)
    config = config_class(embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, image_size=IMAGE,
                          patch_size=2, num_labels=10)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "relative_position_bias_table" in name:
                param.normal_(0.0, 0.5)
    return model


def attention_units(model) -> dict:
    """The model's attention units (:func:`optkit.passes.prune.hf.head_units.find_interiors`) by module name."""
    from optkit.kinds import example_inputs
    from optkit.passes.prune.hf.head_units import find_interiors

    return {u.name: u for u in find_interiors(model, example_inputs(model, (1, 3, IMAGE, IMAGE)))}
