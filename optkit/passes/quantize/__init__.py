"""INT8 quantization of an exported ONNX model (ONNX Runtime static QDQ or dynamic), verified on the task;
language models dynamically, verified by perplexity on text (:mod:`optkit.passes.quantize.tokens`).

Names are re-exported lazily, so reading the settings (the CLI does) imports neither numpy nor ONNX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CALIBRATION_METHODS": "optkit.passes.quantize.settings",
    "MODES": "optkit.passes.quantize.settings",
    "Int8Settings": "optkit.passes.quantize.settings",
    "Int8": "optkit.passes.quantize.passes",
    "quantize_exported": "optkit.passes.quantize.passes",
    "QuantizeResult": "optkit.passes.quantize.api",
    "quantize_onnx": "optkit.passes.quantize.api",
    "TokenQuantizeResult": "optkit.passes.quantize.tokens",
    "quantize_tokens": "optkit.passes.quantize.tokens",
    "compare_latency": "optkit.passes.quantize.latency",
    "interleaved_latency": "optkit.analysis.latency",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'optkit.passes.quantize' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
