"""Save a pruned ``transformers`` image model and check that its stock class loads it back unchanged."""

from __future__ import annotations

import torch

IMAGE = 32


def pixels() -> torch.Tensor:
    """A fixed batch of two 32x32 RGB images."""
    return torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))


def assert_stock_class_reloads(pruned, stock_class, folder) -> None:
    """``save_pretrained`` then ``stock_class.from_pretrained``: no missing, unexpected or mis-shaped keys, and the
    reload's logits equal the pruned model's to 1e-5."""
    pruned.save_pretrained(folder)
    stock, info = stock_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        torch.testing.assert_close(stock.eval()(pixel_values=pixels()).logits, pruned(pixel_values=pixels()).logits,
                                   atol=1e-5, rtol=0)
