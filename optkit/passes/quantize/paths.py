"""Where the INT8 files go, beside the FP32 ones they are made from."""

from __future__ import annotations

import os
from pathlib import Path


def int8_path(fp32_path: str | os.PathLike) -> Path:
    """Where the INT8 model of ``fp32_path`` goes: ``NAME.onnx`` -> ``NAME.int8.onnx``."""
    return Path(fp32_path).with_suffix(".int8.onnx")


def decode_int8_path(fp32_path: str | os.PathLike) -> Path:
    """Where the INT8 decode-step graph of a language model's ``fp32_path`` goes: ``NAME.onnx`` ->
    ``NAME.decode.int8.onnx`` (its FP32 decode graph is :func:`optkit.export.decode.decode_path`'s)."""
    from optkit.export.decode import decode_path

    return int8_path(decode_path(fp32_path))
