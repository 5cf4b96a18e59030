"""Weight-only INT8/INT4 of an ONNX file: ONNX Runtime's block-quantized ``MatMulNBits``.

How small language models are deployed on CPUs: the weights of every MatMul
with a constant weight are stored in 8 or 4 bits, one scale (and, asymmetric,
one zero point) per block of ``block_size`` input channels, and ONNX Runtime's
``MatMulNBits`` kernel multiplies with them directly
(``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``). The
embedding lookup (``Gather``) stays FP32. Nothing here checks the result: the
caller verifies it on the task (:mod:`optkit.passes.deploy.tokens`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from optkit.core.errors import ExportError, first_line

#: Block sizes MatMulNBits takes here (weights per scale along the input).
BLOCK_SIZES = (32, 64, 128)
#: MatMulNBits' ``accuracy_level`` 4: activations quantized to INT8 per block and multiplied in integers (VNNI);
#: lower levels dequantize the weights to FP32 first, which reads the same bytes but computes more slowly.
ACCURACY_LEVEL = 4
#: A file this large is written with its weights in ``NAME.data`` beside it (one protobuf holds at most 2 GB).
EXTERNAL_DATA_BYTES = 2 ** 31 - 2 ** 26


def quantize_weights(source: str | os.PathLike, target: str | os.PathLike, bits: int, *, block_size: int,
                     symmetric: bool = True) -> int:
    """Write ``source`` with its MatMul weights quantized to ``bits`` bits in blocks (``MatMulNBits``) as ``target``.

    Args:
        source: an ONNX file.
        target: where the quantized file goes (not atomic: write into a scratch folder and move it).
        bits: 8 or 4.
        block_size: input channels per scale, one of :data:`BLOCK_SIZES`.
        symmetric: no zero points (the scale alone maps the weights).

    Returns:
        the number of MatMuls quantized.

    Raises:
        ValueError: for bits other than 8 or 4, or a block size not in :data:`BLOCK_SIZES`.
        ExportError: if ONNX Runtime cannot quantize the file or finds no MatMul with a constant weight.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if bits not in (4, 8) or block_size not in BLOCK_SIZES:
        raise ValueError(f"weight-only quantization takes 4 or 8 bits and a block size among {BLOCK_SIZES}, got "
                         f"{bits} bits, block size {block_size}")
    path = Path(source)
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    # It logs every node it visits at INFO.
    logger.setLevel(logging.WARNING)
    try:
        quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), bits=bits, block_size=block_size,
                                         is_symmetric=symmetric, accuracy_level=ACCURACY_LEVEL)
        quantizer.process()
    except Exception as e:
        raise ExportError(f"ONNX Runtime could not quantize the weights of {path.name} to {bits} bits: "
                          f"{first_line(e)}") from e
    finally:
        logger.setLevel(level)
    quantized = sum(node.op_type == "MatMulNBits" for node in quantizer.model.model.graph.node)
    if not quantized:
        raise ExportError(f"{path.name} has no MatMul with a constant weight to quantize to {bits} bits")
    size = path.stat().st_size + sum(data.stat().st_size for data in path.parent.glob(f"{path.name}.data"))
    quantizer.model.save_model_to_file(os.fspath(target), use_external_data_format=size > EXTERNAL_DATA_BYTES)
    return quantized
