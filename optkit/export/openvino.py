"""OpenVINO IR written from a verified ONNX file: NNCF's INT8 quantization and weight compression, the ``.xml`` +
``.bin`` pair saved with the precision it was verified at, and published atomically.

Reading, compiling and running IR is :mod:`optkit.runtime.openvino`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optkit.core.errors import ExportError, first_line
from optkit.runtime.openvino import RT_PRECISION, nncf_module, openvino_module

IR_SUFFIXES = (".xml", ".bin")


def quantize(model: Any, batches: Sequence[Any]) -> Any:
    """``model`` quantized to INT8 by NNCF post-training quantization, calibrated on ``batches`` (quietly).

    Args:
        model: an ``openvino.Model`` (not changed).
        batches: model inputs (float32 arrays, batch first), each fed as the model's one input.

    Raises:
        ExportError: if NNCF is missing or fails.
    """
    nncf = nncf_module()
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        # NNCF draws progress bars on stdout and warns on stderr; the caller reports what matters.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return nncf.quantize(model.clone(), nncf.Dataset(list(batches)), subset_size=len(batches))
    except Exception as e:
        raise ExportError(f"NNCF could not quantize the model: {first_line(e)}") from e
    finally:
        logger.setLevel(level)


def compress_weights(model: Any, bits: int, *, group_size: int, symmetric: bool) -> Any:
    """``model`` with its weights compressed by NNCF (``compress_weights``, no data): INT8 per output channel
    (asymmetric), or INT4 in groups of ``group_size`` along the input (``INT4_SYM``/``INT4_ASYM``; NNCF keeps the
    embeddings and the last layer in INT8). Activations stay in floating point.

    Args:
        model: an ``openvino.Model`` (not changed).
        bits: 8 or 4.
        group_size: INT4 weights per scale.
        symmetric: INT4 without zero points.

    Raises:
        ExportError: if NNCF is missing or fails.
    """
    nncf = nncf_module()
    mode = nncf.CompressWeightsMode
    options = ({"mode": mode.INT8_ASYM} if bits == 8 else
               {"mode": mode.INT4_SYM if symmetric else mode.INT4_ASYM, "group_size": group_size, "ratio": 1.0})
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return nncf.compress_weights(model.clone(), **options)
    except Exception as e:
        raise ExportError(f"NNCF could not compress the weights: {first_line(e)}") from e
    finally:
        logger.setLevel(level)


def save(model: Any, xml_path: str | os.PathLike, precision: str) -> int:
    """Write ``model`` as IR (``NAME.xml`` + ``NAME.bin``, weights as they are) recording ``precision``.

    Not atomic: write into a scratch folder and :func:`publish` the verified files.

    Returns:
        the bytes of both files.
    """
    model.set_rt_info(precision, RT_PRECISION)
    openvino_module().save_model(model, os.fspath(xml_path), compress_to_fp16=False)
    return ir_size(xml_path)


def ir_files(xml_path: str | os.PathLike) -> list[Path]:
    """The IR's two files: ``NAME.xml`` and ``NAME.bin``."""
    return [Path(xml_path).with_suffix(suffix) for suffix in IR_SUFFIXES]


def ir_size(xml_path: str | os.PathLike) -> int:
    """Bytes of the IR's ``.xml`` and ``.bin`` together."""
    return sum(path.stat().st_size for path in ir_files(xml_path))


def publish(source_xml: str | os.PathLike, target_xml: str | os.PathLike) -> None:
    """Move a written IR into place, the ``.bin`` first, so a ``.xml`` never names weights that are not there yet."""
    sources, targets = ir_files(source_xml), ir_files(target_xml)
    for source in sources:
        with open(source, "rb") as f:
            os.fsync(f.fileno())
    for source, target in zip(reversed(sources), reversed(targets)):
        os.replace(source, target)
