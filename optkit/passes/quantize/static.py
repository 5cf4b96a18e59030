"""ONNX Runtime quantization of one file: graph pre-processing, static QDQ and dynamic quantization.

Static quantization calibrates once: the activation ranges are kept in a
calibration cache, so re-quantizing with other nodes excluded (the op-speed rule
and the exclusion search do this many times) costs no calibration runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import platform
from collections.abc import Collection
from pathlib import Path

from optkit.core.errors import ExportError, first_line
from optkit.passes.quantize.calibration import Batches, calibration_reader

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
#: x86-64 CPU flags (Linux ``/proc/cpuinfo`` names) of the VNNI instructions, which sum INT8 products in int32.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
REDUCED_RANGE_NOTE = ("this CPU has no VNNI instructions, where ONNX Runtime's INT8 kernels add pairs of products in "
                      "16 bits and can saturate: weights were quantized to 7 bits (reduce_range), which avoids it; "
                      "a file quantized on a CPU with VNNI loses accuracy on one without")


@functools.lru_cache(maxsize=1)
def int8_can_saturate(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether ONNX Runtime's U8S8 kernels can saturate on this CPU: x86-64 without VNNI.

    There, VPMADDUBSW adds pairs of u8 x s8 products into int16, which overflows for large weights and
    activations (measured: a two-layer MLP's INT8 outputs 5 % off FP32 instead of 0.7 % with 7-bit weights).
    An x86-64 CPU whose flags cannot be read counts as one that saturates; other architectures never do.
    """
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return True
    return not any(flag in flags for flag in VNNI_FLAGS)


def preprocess(fp32_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Shape inference and graph optimization before quantization (``quant_pre_process``).

    Symbolic shape inference fails on some graphs; those are pre-processed with ONNX's own shape inference only.

    Raises:
        ExportError: if the file cannot be pre-processed at all.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    errors = []
    for skip_symbolic in (False, True):
        try:
            with _quiet():
                quant_pre_process(str(fp32_path), str(out_path), skip_symbolic_shape=skip_symbolic)
            return
        except Exception as e:  # noqa: BLE001 - the fallback below decides
            errors.append(first_line(e))
    raise ExportError(f"{fp32_path}: ONNX Runtime's quantization pre-processing failed ({'; '.join(errors)}); "
                      "re-export the model (optkit export) and try again")


def input_name(path: str | os.PathLike) -> str:
    """The name of a single-input ONNX model's input.

    Raises:
        ExportError: if the model has several inputs.
    """
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    if len(names) != 1:
        raise ExportError(f"{path} has {len(names)} inputs; INT8 quantization here takes single-input models")
    return names[0]


def quantize_file(pre_path: str | os.PathLike, out_path: str | os.PathLike, *, mode: str, method: str,
                  per_channel: bool, op_types: Collection[str], exclude: Collection[str],
                  calibration: Batches | None, cache_path: str | os.PathLike | None) -> None:
    """Quantize a pre-processed FP32 file to ``out_path``.

    Args:
        pre_path: the pre-processed FP32 model.
        out_path: where the INT8 model goes (overwritten).
        mode: ``static`` (QDQ, U8 activations, S8 weights) or ``dynamic`` (S8 weights).
        method: ``minmax``, ``entropy`` or ``percentile`` (static only).
        per_channel: one weight scale per output channel.
        op_types: op types to quantize.
        exclude: node names left in FP32.
        calibration: the calibration batches (static; unused when the cache holds the ranges).
        cache_path: calibration cache (static): read when it exists, written otherwise.

    Weights are quantized to 7 bits where :func:`int8_can_saturate` (``REDUCED_RANGE_NOTE``).

    Raises:
        ExportError: if ONNX Runtime fails to quantize the model.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    reduce_range = int8_can_saturate()
    try:
        with _quiet():
            if mode == "dynamic":
                quantize_dynamic(str(pre_path), str(out_path), op_types_to_quantize=list(op_types),
                                 per_channel=per_channel, reduce_range=reduce_range, weight_type=QuantType.QInt8,
                                 nodes_to_exclude=list(exclude))
                return
            reader = calibration_reader(calibration, input_name(pre_path)) if calibration is not None else None
            quantize_static(str(pre_path), str(out_path), reader, quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=list(op_types), per_channel=per_channel,
                            reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_exclude=list(exclude), calibrate_method=getattr(CalibrationMethod, METHODS[method]),
                            calibration_cache_path=None if cache_path is None else str(cache_path),
                            extra_options={"QDQKeepRemovableActivations": True})
        if exclude:
            _float_inputs(out_path, set(exclude))
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"ONNX Runtime could not quantize {Path(pre_path).name} ({first_line(e)})") from e


def _float_inputs(path: str | os.PathLike, nodes: set[str]) -> None:
    """Feed the FP32 nodes their inputs before Quantize/Dequantize, and drop the Q/DQ pairs left unused.

    ONNX Runtime quantizes a float Conv/Gemm's weights per tensor when it loads the file
    (its WeightBiasQuantization optimizer) if the node sits between a DequantizeLinear and a
    QuantizeLinear, so an excluded node must not take a dequantized input to stay FP32.
    Removable activations (Relu, Clip) are kept by the quantizer, so the tensor before the Q
    holds the real clipped values.
    """
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.name not in nodes:
            continue
        for i, name in enumerate(node.input):
            dq = producer.get(name)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[i] = q.input[0]
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    while True:
        dead = [n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = {i for n in graph.node for i in n.input}
    for init in [init for init in graph.initializer if init.name not in kept]:
        graph.initializer.remove(init)
    onnx.save(model, str(path))


def supported_op_types(mode: str) -> set[str]:
    """The op types ONNX Runtime's quantizer handles in ``mode``."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    return set(IntegerOpsRegistry) if mode == "dynamic" else set(QDQRegistry) | set(QLinearOpsRegistry)


@contextlib.contextmanager
def _quiet():
    """ONNX Runtime's quantizer logs progress through the root logger and prints; keep optkit's output clean."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
