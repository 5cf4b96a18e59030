"""OpenVINO, the second deployment runtime: whether it is here, reading a file, compiling it for the CPU at a precision.

Writing IR (NNCF's INT8, saving, publishing) is :mod:`optkit.export.openvino`.

OpenVINO is an optional extra (``pip install -e '.[openvino]'`` in an optkit checkout, which also
installs NNCF for INT8). The precisions:

* ``fp32``: the CPU plugin computes in f32 (``INFERENCE_PRECISION_HINT`` set to
  ``f32`` explicitly: on CPUs with bf16 instructions OpenVINO's default is bf16);
* ``bf16``: ``INFERENCE_PRECISION_HINT`` ``bf16``, on CPUs with bf16 instructions;
* ``int8``: the IR quantized by NNCF post-training quantization; the ops left in
  floating point compute in bf16 where the CPU has it, else in f32.

The precision is a setting of ``compile_model``, not part of the IR: optkit
records it in the IR's ``rt_info`` (``optkit/precision``) and
:func:`compile_model` reads it back, so a file compiles at the precision it was
verified at. Anyone else compiles with ``{"INFERENCE_PRECISION_HINT": hint}``
(:func:`compute_hint`).

Nothing here sends usage data: the ONNX file is read with ``Core.read_model``
(``openvino.convert_model`` reports every conversion), and NNCF is imported with
its telemetry off.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from optkit.core.errors import ExportError, first_line

PRECISIONS = ("fp32", "bf16", "int8")
#: Weight-only compressed IR (NNCF ``compress_weights``: INT8 or INT4 weights, activations in floating point),
#: which an IR records like a precision; they compute as INT8 does (:func:`compute_hint`).
WEIGHT_PRECISIONS = ("w8", "w4")
#: How to add OpenVINO: optkit is installed from its checkout (``make setup``), so the extra is an editable install.
INSTALL = "pip install -e '.[openvino]'"
MISSING_NOTE = (f"OpenVINO is not installed: `{INSTALL}` (in the optkit checkout) adds OpenVINO fp32, bf16 and "
                "INT8 deployments (--openvino, "
                "and more candidates for --deploy), often faster than ONNX Runtime on Intel and AMD CPUs")
#: Where the IR records the precision it was verified at.
RT_PRECISION = ["optkit", "precision"]


def openvino_module() -> Any:
    """The ``openvino`` package.

    Raises:
        ExportError: saying how to install it, when it is missing.
    """
    try:
        import openvino
    except ImportError as e:
        raise ExportError(f"OpenVINO is not installed; {INSTALL} to deploy with it") from e
    return openvino


def nncf_module() -> Any:
    """NNCF, imported with its telemetry off.

    NNCF sends usage events to Google Analytics unless ``NNCF_CI`` is set when it is first
    imported (its only effect); optkit never reaches the network, so it sets it for the import.
    """
    if "nncf" not in sys.modules:
        previous = os.environ.get("NNCF_CI")
        os.environ["NNCF_CI"] = "1"
        try:
            importlib.import_module("nncf")
        except ImportError as e:
            raise ExportError(f"OpenVINO INT8 needs NNCF, which is not installed; {INSTALL}") from e
        finally:
            if previous is None:
                del os.environ["NNCF_CI"]
            else:
                os.environ["NNCF_CI"] = previous
    return sys.modules["nncf"]


def available() -> bool:
    """Whether OpenVINO can be imported here."""
    try:
        openvino_module()
    except ExportError:
        return False
    return True


def missing_note() -> str | None:
    """:data:`MISSING_NOTE` when OpenVINO is not installed, else ``None``."""
    return None if available() else MISSING_NOTE


@lru_cache(maxsize=1)
def core() -> Any:
    """The process's ``openvino.Core`` (created once: it loads the CPU plugin)."""
    return openvino_module().Core()


def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes bf16 natively here (``BF16`` in its optimization capabilities)."""
    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def unavailable(precision: str) -> str | None:
    """Why ``precision`` cannot run here, in words, or ``None`` when it can.

    Raises:
        ValueError: for a precision not in :data:`PRECISIONS` or :data:`WEIGHT_PRECISIONS`.
    """
    if precision not in PRECISIONS + WEIGHT_PRECISIONS:
        raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISIONS + WEIGHT_PRECISIONS)}, got "
                         f"{precision!r}")
    if not available():
        return f"OpenVINO is not installed ({INSTALL})"
    if precision == "bf16" and not cpu_has_bf16():
        return "this CPU has no bf16 instructions, so OpenVINO would compute in f32: use fp32"
    if precision in ("int8", *WEIGHT_PRECISIONS):
        try:
            nncf_module()
        except ExportError as e:
            return str(e)
    return None


def compute_hint(precision: str) -> str:
    """The ``INFERENCE_PRECISION_HINT`` a file of ``precision`` compiles with (``f32`` or ``bf16``): INT8 and
    weight-only compressed files compute their floating-point parts in bf16 where the CPU has it."""
    if precision == "bf16" or (precision in ("int8", *WEIGHT_PRECISIONS) and cpu_has_bf16()):
        return "bf16"
    return "f32"


def read(path: str | os.PathLike) -> Any:
    """An ``openvino.Model`` read from an ONNX file or an IR ``.xml`` (with its ``.bin``).

    Raises:
        ExportError: if OpenVINO is missing or cannot read the file.
    """
    openvino_module()
    try:
        return core().read_model(os.fspath(path))
    except Exception as e:
        raise ExportError(f"OpenVINO cannot read {path}: {first_line(e)}") from e


def recorded_precision(model: Any) -> str | None:
    """The precision an optkit IR records (:data:`RT_PRECISION`), or ``None``."""
    if not model.has_rt_info(RT_PRECISION):
        return None
    value = model.get_rt_info(RT_PRECISION).astype(str)
    return value if value in PRECISIONS + WEIGHT_PRECISIONS else None


def compile_model(model: Any, *, precision: str | None = None, threads: int | None = None,
                  input_shape: Sequence[int] | None = None) -> Any:
    """Compile a model for OpenVINO's CPU plugin at a precision, for one stream of low-latency calls.

    Args:
        model: an IR ``.xml`` or ONNX path, or an ``openvino.Model`` (reshaped in place with ``input_shape``).
        precision: one of :data:`PRECISIONS` or :data:`WEIGHT_PRECISIONS` (``None``: the one the file records,
            else ``fp32``).
        threads: inference threads (``None``: OpenVINO's choice, every core).
        input_shape: compile for this input shape (batch first) instead of the file's dynamic one, as a
            deployment at a fixed batch does.

    Returns:
        the ``openvino.CompiledModel``.

    Raises:
        ExportError: if OpenVINO is missing, the precision cannot run here, or the model does not compile.
    """
    model = read(model) if isinstance(model, (str, os.PathLike)) else model
    precision = precision or recorded_precision(model) or "fp32"
    reason = unavailable(precision)
    if reason is not None:
        raise ExportError(f"OpenVINO {precision} cannot run here: {reason}")
    if input_shape is not None:
        fix_shape(model, input_shape)
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": compute_hint(precision), "PERFORMANCE_HINT": "LATENCY",
                              "NUM_STREAMS": 1}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    try:
        return core().compile_model(model, "CPU", config)
    except Exception as e:
        raise ExportError(f"OpenVINO cannot compile the model: {first_line(e)}") from e


def fix_shape(model: Any, input_shape: Sequence[int]) -> None:
    """Fix an ``openvino.Model``'s input shapes in place: ``input_shape`` for inputs of its rank, ``input_shape[1:]``
    for one image of a list.

    Raises:
        ExportError: if the model does not take that shape.
    """
    shape = tuple(int(v) for v in input_shape)
    shapes = {}
    for node in model.inputs:
        rank = node.get_partial_shape().rank.get_length()
        if rank in (len(shape), len(shape) - 1):
            shapes[node.get_any_name()] = list(shape if rank == len(shape) else shape[1:])
    try:
        model.reshape(shapes)
    except Exception as e:
        raise ExportError(f"the model does not take input shape {','.join(map(str, shape))}: {first_line(e)}") from e


def run(compiled: Any, batch: Any) -> Any:
    """The first output of a compiled model on one input batch (or a feed of every input by name), as a float32
    array."""
    import numpy as np

    return np.asarray(compiled(batch if isinstance(batch, dict) else {0: batch})[0], dtype=np.float32)


def openvino_feed(compiled: Any, shape: Sequence[int], *, seed: int = 0) -> dict[int, Any]:
    """Inputs for every input of an OpenVINO compiled model, by index, as
    :func:`optkit.runtime.onnxrt.onnx_feed` makes them: the same values for the same file, whichever runtime
    runs it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in shape)
    feed = {}
    for index, node in enumerate(compiled.inputs):
        size = shape[1:] if node.get_partial_shape().rank.get_length() == len(shape) - 1 else shape
        dtype = node.get_element_type()
        if dtype.is_real():
            feed[index] = rng.standard_normal(size, dtype=np.float32)
        else:
            feed[index] = np.ones(size, dtype=np.int32 if dtype.get_type_name() == "i32" else np.int64)
    return feed


#: ONNX Runtime's names of the element types an OpenVINO port may have (``NodeArg.type``).
_ORT_TYPES = {"f32": "tensor(float)", "f16": "tensor(float16)", "bf16": "tensor(bfloat16)", "i64": "tensor(int64)",
              "i32": "tensor(int32)", "boolean": "tensor(bool)"}


def port_name(port: Any) -> str:
    """A port's name as the ONNX graph gave it: OpenVINO may add internal names (``/Concat_output_0``) to an
    input that feeds a node directly, and ``get_any_name`` may return either."""
    return min(sorted(port.get_names()), key=lambda name: name.startswith("/"))


class Session:
    """An OpenVINO compiled model called the way an ONNX Runtime session is (``get_inputs``, ``get_outputs``,
    ``run(None, feed)`` with a feed by input name), so what runs an ONNX file a call at a time (scoring on
    text, a decode graph's steps and their timing) runs an IR the same way.

    Args:
        compiled: the ``openvino.CompiledModel`` (see :func:`compile_model`); one infer request serves every call.
    """

    def __init__(self, compiled: Any):
        self.compiled = compiled
        self.request = compiled.create_infer_request()

    def get_inputs(self) -> list[Any]:
        return [_port_info(port) for port in self.compiled.inputs]

    def get_outputs(self) -> list[Any]:
        return [_port_info(port) for port in self.compiled.outputs]

    def run(self, output_names: Sequence[str] | None, feed: dict[str, Any]) -> list[Any]:
        """The outputs (all, or those named) on ``feed``, as numpy arrays the next call does not overwrite."""
        import numpy as np

        result = self.request.infer(feed)
        outputs = self.compiled.outputs
        wanted = outputs if output_names is None else [next(p for p in outputs if name in p.get_names())
                                                        for name in output_names]
        return [np.array(result[port]) for port in wanted]


def _port_info(port: Any) -> Any:
    """A port as ONNX Runtime describes an input or output: ``name``, ``type``, ``shape`` (``None``: dynamic)."""
    from types import SimpleNamespace

    return SimpleNamespace(name=port_name(port), type=_ORT_TYPES.get(port.get_element_type().get_type_name(),
                                                                     "tensor(float)"),
                           shape=[d.get_length() if d.is_static else None for d in port.get_partial_shape()])


def session(path: str | os.PathLike, threads: int | None = None, *, precision: str | None = None) -> Session:
    """A :class:`Session` of an IR (or ONNX) file compiled at ``precision`` (``None``: the one it records), its
    shapes left dynamic.

    Raises:
        ExportError: as :func:`compile_model` does.
    """
    return Session(compile_model(path, precision=precision, threads=threads))
