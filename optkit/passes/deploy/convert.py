"""``openvino_ir``: a verified ONNX file to an OpenVINO IR at one precision, checked on the task before it is written.

Steps: read the ONNX file with OpenVINO, quantize it with NNCF for ``int8``
(calibrated on the ``train`` split of ``calib_data``), write the IR into a
scratch folder, compile what was written at the precision and compare it with
the FP32 file in ONNX Runtime on the same inputs (the ``val`` split of
``calib_data``): top-1 agreement and accuracy like INT8 today, and for ``fp32``
also every output within the export's tolerance. A miss within sampling noise
is checked again on four times the images, which decide
(:func:`optkit.passes.quantize.verify.decided`). Only a model that passes is
moved into place; on any failure nothing is written.

A model of several inputs (token ids and an attention mask) is converted the
same way and checked on reproducible example inputs for every input
(:func:`optkit.runtime.onnxrt.onnx_feed`): ``fp32`` to the export's tolerance,
``bf16``/``int8`` (calibrated on such inputs too) only with
``random_calibration``, for timing; data of one input cannot feed it. A
language model's deployments are checked on its task, by perplexity, by
:mod:`optkit.passes.deploy.tokens`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optkit.core.errors import DataError, ExportError
from optkit.core.settings import check_input_shape
from optkit.export import openvino as ir
from optkit.passes.deploy.settings import CheckSettings
from optkit.passes.quantize import verify
from optkit.passes.quantize.calibration import Batches, load_batches
from optkit.runtime import openvino as ov

#: fp32 outputs must match ONNX Runtime's within this fraction of the largest output, like the ONNX export's check.
FP32_RTOL = 1e-3
NO_DATA = ("OpenVINO {precision} computes differently from FP32, so it is checked on images like the ones the model "
           "will see: give --calib-data SPEC (--random-calibration allows random inputs, for timing only)")
RANDOM_NOTE = ("OpenVINO {precision} was checked on random inputs, not images, so its accuracy is unknown: the file is "
               "fit for timing only")
SEVERAL_INPUTS = ("{name} takes {count} inputs ({names}): OpenVINO {precision} is checked on data only for models of "
                  "one input here (a language model's --deploy checks its OpenVINO deployments by perplexity on text); "
                  "--random-calibration checks it on example inputs instead, for timing only")
#: Batches of example inputs a model of several inputs is checked (and INT8-calibrated) on.
EXAMPLE_BATCHES = 2


@dataclass
class OpenVinoResult:
    """What :func:`openvino_ir` wrote and how it was checked.

    Attributes:
        path: the IR's ``.xml`` file (its weights are the ``.bin`` beside it).
        precision: ``fp32``, ``bf16`` or ``int8``.
        compute: the ``INFERENCE_PRECISION_HINT`` it compiles with (``f32`` or ``bf16``).
        file_size: bytes of the ``.xml`` and ``.bin``.
        checked_on: where the checking inputs came from.
        samples: checking inputs.
        agreement: top-1 agreement with the FP32 file in ONNX Runtime.
        relative_error: ``||openvino - fp32|| / ||fp32||`` of the outputs.
        max_abs_diff: largest absolute difference from the FP32 outputs.
        tolerance: the largest difference allowed (``fp32`` only; lower precisions are checked on the task).
        accuracy_fp32, accuracy: top-1 accuracy of both when the inputs have labels, else ``None``.
        calibration: where the INT8 calibration inputs came from (``None`` unless ``int8``).
        seconds: wall time.
        notes: plain-language remarks for the report.
    """

    path: str
    precision: str
    compute: str
    file_size: int
    checked_on: str
    samples: int
    agreement: float
    relative_error: float
    max_abs_diff: float
    tolerance: float | None
    accuracy_fp32: float | None
    accuracy: float | None
    calibration: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def openvino_ir(onnx_path: str | os.PathLike, xml_path: str | os.PathLike, precision: str,
                settings: CheckSettings | None = None, *, input_shape: tuple[int, ...]) -> OpenVinoResult:
    """Write the FP32 ONNX file as an OpenVINO IR at ``precision``, checked on the task before it appears.

    Args:
        onnx_path: the verified FP32 ONNX file (from :func:`optkit.export.onnx.export_onnx`).
        xml_path: the IR's ``.xml`` (the ``.bin`` goes beside it); written only when the IR passes.
        precision: ``fp32``, ``bf16`` or ``int8`` (see :mod:`optkit.export.openvino`).
        settings: the check (and INT8 calibration) settings; defaults when ``None``.
        input_shape: the model input shape, batch first.

    Returns:
        the :class:`OpenVinoResult`.

    Raises:
        ExportError: if OpenVINO (or NNCF for ``int8``) is missing, the precision cannot run on this CPU, or the
            IR misses a check (nothing is written then).
        DataError: for ``bf16``/``int8`` without ``calib_data`` or ``random_calibration`` (a model of several
            inputs: without ``random_calibration``), or unusable data.
    """
    start = time.perf_counter()
    settings = settings or CheckSettings()
    shape = check_input_shape(input_shape)
    reason = ov.unavailable(precision)
    if reason is not None:
        raise ExportError(f"OpenVINO {precision} cannot run here: {reason}; nothing was written")
    source = Path(onnx_path)
    if not source.is_file():
        raise ExportError(f"{source} not found; export the model first (optkit export MODEL --onnx {source})")
    model = ov.read(source)
    shape, fixed = _fit_shape(model, shape)
    batch = shape[0] if fixed else settings.batch_size
    several = len(model.inputs) > 1
    if several and precision != "fp32" and not settings.random_calibration:
        raise DataError(SEVERAL_INPUTS.format(name=source.name, count=len(model.inputs), precision=precision,
                                              names=", ".join(ov.port_name(port) for port in model.inputs)))
    checking = (_example_batches(source, shape, settings.seed + 1) if several else
                _checking_batches(precision, settings, shape, batch))
    calibration = None
    if precision == "int8":
        calibration = (_example_batches(source, shape, settings.seed) if several else
                       load_batches(settings.calib_data, "train", shape, batch_size=batch,
                                    samples=settings.calibration_batches * batch,
                                    random=settings.random_calibration, seed=settings.seed))
        model = ir.quantize(model, calibration.inputs)
    target = Path(xml_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".openvino", dir=target.parent))
    try:
        written = scratch / target.name
        size = ir.save(model, written, precision)
        result = _check(source, written, precision, settings, checking,
                        None if several or settings.calib_data is None else verify.wider_batches(
                            settings.calib_data, shape, batch, settings.eval_samples, settings.seed + 1))
        ir.publish(written, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    notes = [RANDOM_NOTE.format(precision=precision)] if checking.source == "random" and precision != "fp32" else []
    return OpenVinoResult(str(target), precision, ov.compute_hint(precision), size, checking.source,
                          *result, calibration.source if calibration is not None else None,
                          round(time.perf_counter() - start, 3), notes)


def _checking_batches(precision: str, settings: CheckSettings, shape: tuple[int, ...], batch: int) -> Batches:
    """The ``val`` split of the data; without data, random inputs for ``fp32`` (checked to 1e-3 like the export)."""
    if settings.calib_data is None and precision != "fp32" and not settings.random_calibration:
        raise DataError(NO_DATA.format(precision=precision))
    samples = settings.eval_samples if settings.calib_data is not None else min(settings.eval_samples, 2 * batch)
    return load_batches(settings.calib_data, "val", shape, batch_size=batch, samples=samples,
                        random=settings.calib_data is None, seed=settings.seed + 1)


def _example_batches(source: Path, shape: tuple[int, ...], seed: int) -> Batches:
    """:data:`EXAMPLE_BATCHES` feeds of every input of ``source`` at ``shape`` (as timing feeds them)."""
    from optkit.runtime.onnxrt import onnx_feed, onnx_session

    session = onnx_session(source, 1, spinning=False)
    feeds = [onnx_feed(session, shape, seed=seed + index) for index in range(EXAMPLE_BATCHES)]
    return Batches(feeds, None, "random")


def _check(fp32_path: Path, xml_path: Path, precision: str, settings: CheckSettings, checking: Batches,
           wider: Callable[[], Batches] | None) -> tuple[int, float, float, float, float | None, float | None,
                                                           float | None]:
    """``(images, agreement, relative error, max |diff|, tolerance, FP32 accuracy, accuracy)`` of the written IR on
    ``checking``, or, when it misses within sampling noise, on the ``wider()`` images
    (:func:`optkit.passes.quantize.verify.decided`).

    Raises:
        ExportError: naming what it missed.
    """
    compiled = ov.compile_model(xml_path, precision=precision)
    diffs: dict[int, tuple[float, float]] = {}  # by image count: (max |diff|, max |output|) of each comparison

    def compared(batches: Batches) -> verify.Agreement:
        import numpy as np

        reference = verify.outputs(fp32_path, batches, threads=os.cpu_count() or 1)
        actual = np.concatenate([ov.run(compiled, x).reshape(len(next(iter(x.values())) if isinstance(x, dict)
                                                                 else x), -1) for x in batches.inputs])
        found = verify.agreement(reference, actual, np.concatenate(batches.labels) if batches.labels else None)
        diffs[found.samples] = float(np.abs(actual - reference).max()), float(np.abs(reference).max())
        return found

    found, missed = verify.decided(compared(checking), settings.min_agreement, settings.max_accuracy_drop,
                                   None if wider is None else lambda: compared(wider()))
    diff, largest = diffs[found.samples]
    tolerance = FP32_RTOL * largest if precision == "fp32" else None
    if tolerance is not None and diff > tolerance:
        missed.append(f"max |diff| {diff:.3g} > tolerance {tolerance:.3g} ({FP32_RTOL:g} x max |output|)")
    if missed:
        raise ExportError(f"OpenVINO {precision} missed the check on {verify.checked_on(checking, found.samples)}: "
                          f"{'; '.join(missed)}; nothing was written (lower --min-agreement or raise "
                          "--max-accuracy-drop, or use a higher precision)")
    return (found.samples, found.agreement, found.relative_error, diff, tolerance, found.accuracy_fp32,
            found.accuracy_int8)


def _fit_shape(model: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """``shape`` checked against the model's first input (a fixed batch replaces the given one), and whether
    the batch is fixed.

    Raises:
        DataError: if the model declares other sizes.
    """
    dims = [d.get_length() if d.is_static else None for d in model.inputs[0].get_partial_shape()]
    if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims[1:], shape[1:])):
        declared = tuple(d or "?" for d in dims)
        raise DataError(f"the model takes input {declared} but input_shape is {shape}; set --input-shape to the "
                        "model's input")
    return ((dims[0], *shape[1:]), True) if dims[0] else (shape, False)
