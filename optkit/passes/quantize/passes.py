"""``int8``: the exported ONNX model quantized by ONNX Runtime, checked on the task, and timed against FP32.

The work is :func:`optkit.passes.quantize.quantize_onnx`, or for a language
model :func:`optkit.passes.quantize.tokens.quantize_tokens` (dynamic INT8
verified by perplexity on text); the settings are
:class:`optkit.passes.quantize.settings.Int8Settings`'s, declared once. The INT8
file is written beside the FP32 one (``model.onnx`` -> ``model.int8.onnx``), and
a language model's decode graph beside its own (``model.decode.onnx`` ->
``model.decode.int8.onnx``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optkit.core.contract import Pass, PassResult, Stage
from optkit.core.forms import ONNX, OnnxModel
from optkit.core.registry import register_pass
from optkit.core.settings import shared_setting
from optkit.passes.quantize.paths import decode_int8_path, int8_path
from optkit.passes.quantize.settings import Int8Settings

__all__ = ["Int8", "decode_int8_path", "int8_path", "quantize_exported"]


@register_pass
@dataclass(frozen=True)
class Int8(Int8Settings, Pass):
    """INT8 quantization of the exported ONNX model (ONNX Runtime static QDQ or dynamic), checked on the task.

    Takes the ONNX form (after ``export_onnx``) and writes ``NAME.int8.onnx`` beside
    ``NAME.onnx`` only when the INT8 model passes its checks; both files are timed
    in ONNX Runtime at batch 1 with every core, for the report. A language model is
    quantized dynamically and checked by perplexity on text, and its decode graph
    (``NAME.decode.onnx``) is quantized, checked and timed in tokens/s too.
    """

    name = "int8"
    flag = "int8"
    stage = Stage.QUANTIZE
    in_place = False
    accepts = ONNX
    produces = ONNX
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def apply(self, model: OnnxModel) -> PassResult:
        """Quantize the ONNX file ``model`` and return the INT8 file as an :class:`OnnxModel`.

        Returns:
            the INT8 form, with what was checked and timed in the details (see :func:`quantize_exported`).

        Raises:
            DataError, ExportError: as :func:`optkit.passes.quantize.quantize_onnx` does; nothing is written then.
        """
        target = int8_path(model.path)
        details = quantize_exported(model.path, target, self, self.input_shape or model.input_shape, model.source)
        return PassResult(OnnxModel(target, model.input_shape, model.source, "int8"), details)


def quantize_exported(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, settings: Int8Settings,
                      input_shape: tuple[int, ...], model: Any = None) -> dict[str, Any]:
    """Quantize an exported file to INT8 (verified on the task) and time both, for the report.

    Args:
        fp32_path: the exported FP32 file.
        int8_path: where the INT8 file goes.
        settings: the INT8 settings.
        input_shape: the model's input shape.
        model: the PyTorch model the file was exported from. A model whose kind is a language model
            (:attr:`optkit.kinds.ModelKind.language_model`) is quantized dynamically and verified by
            perplexity on text, its decode graph too
            (:func:`optkit.passes.quantize.tokens.quantize_language_model`).

    Returns:
        :class:`optkit.passes.quantize.QuantizeResult` as a dict with ``path`` (the file name),
        ``file_size``, ``latency`` (:func:`optkit.passes.quantize.compare_latency` at batch 1 with every
        core) and ``notes`` led by a one-line summary (for a language model,
        :class:`optkit.passes.quantize.tokens.TokenQuantizeResult`'s figures instead).

    Raises:
        DataError, ExportError: as :func:`optkit.passes.quantize.quantize_onnx` does; nothing is written then.
    """
    from optkit.passes.quantize import compare_latency, quantize_onnx

    if model is not None and _is_language_model(model):
        from optkit.passes.quantize.tokens import quantize_language_model

        return quantize_language_model(fp32_path, int8_path, settings, input_shape, model)

    result = quantize_onnx(fp32_path, int8_path, settings, input_shape=input_shape).to_dict()
    result["path"] = Path(int8_path).name
    result["file_size"] = result["int8_size"]
    result["latency"] = compare_latency(fp32_path, int8_path, input_shape, threads=(os.cpu_count() or 1,))
    check = f"agreement {result['agreement']:.1%} with FP32"
    if result.get("accuracy_int8") is not None:
        check += f", accuracy {result['accuracy_fp32']:.2%} -> {result['accuracy_int8']:.2%}"
    timing = "; ".join(f"batch {r['batch_size']}, {r['threads']} thread(s): "
                       + (f"{r['not_a_result']} (" if r.get("not_a_result") else "")
                       + f"{r['fp32']['median_ms']:.2f} -> {r['int8']['median_ms']:.2f} ms"
                       + (")" if r.get("not_a_result") else "") for r in result["latency"]["runs"])
    result["notes"] = [f"{Path(int8_path).name}: {result['mode']} INT8, {result['fp32_size']:,} -> "
                       f"{result['int8_size']:,} bytes, {check}; ONNX Runtime {timing}", *result["notes"]]
    return result


def _is_language_model(model: Any) -> bool:
    from optkit.kinds import kind_of

    return kind_of(model).language_model
