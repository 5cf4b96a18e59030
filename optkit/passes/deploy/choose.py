"""``choose_deployment``: the fastest deployment of an exported model that passes its checks, chosen by measurement.

Every candidate (:data:`optkit.passes.deploy.settings.CANDIDATES`: ONNX Runtime
FP32 and INT8, OpenVINO fp32, bf16 and INT8) is built in a scratch folder and
checked on the task (ONNX Runtime INT8 by :func:`optkit.passes.quantize.quantize_onnx`,
OpenVINO by :func:`optkit.passes.deploy.convert.openvino_ir`); the ones that
pass are timed with the unpruned model's FP32 ONNX file in one interleaved run
(:func:`optkit.analysis.latency.interleaved_latency`) at the user's thread count
and batch. Going from the simplest to the least simple, a candidate is kept only
when it measures at least ``min_gain`` faster than the one kept before it
(:func:`pick`), so the choice is never slower than a simpler verified one. Only
the chosen deployment's files are written beside the FP32 file; every candidate
is listed with its figures or the reason it was not taken.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optkit.core.errors import DataError, ExportError
from optkit.export import openvino as ir
from optkit.passes.deploy.convert import openvino_ir
from optkit.passes.deploy.settings import CANDIDATES, DeploySettings
from optkit.runtime import openvino as ov

#: A timer takes the deployments to time (the baseline first) and returns each one's Latency, in order.
Timer = Callable[[Sequence[Any]], Sequence[Any]]
RUNTIME_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


@dataclass
class Candidate:
    """One deployment the choice tried.

    Attributes:
        name: ``runtime-precision`` (``openvino-bf16``).
        runtime: ``onnxruntime`` or ``openvino``.
        precision: ``fp32``, ``bf16`` or ``int8``.
        status: ``chosen``, ``verified`` (passed, not chosen), ``refused`` (missed a check, or measured no
            faster than a simpler one) or ``unavailable`` (cannot run here).
        reason: why it was not chosen (``None`` for the chosen one).
        check: what its check found (agreement, accuracy, file size), when it was built.
        latency: its :class:`~optkit.analysis.latency.Latency` as a dict, when it was timed.
        speedup: the unpruned FP32 file's median / its median, when it was timed.
    """

    name: str
    runtime: str
    precision: str
    status: str = "verified"
    reason: str | None = None
    check: dict[str, Any] = field(default_factory=dict)
    latency: dict[str, Any] | None = None
    speedup: float | None = None
    built: Path | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        """``OpenVINO bf16``: the runtime and precision in words."""
        return f"{RUNTIME_NAMES[self.runtime]} {self.precision.upper() if self.precision != 'bf16' else 'bf16'}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("built")
        return out


@dataclass
class DeployResult:
    """What :func:`choose_deployment` chose and wrote.

    Attributes:
        runtime, precision: the chosen deployment.
        label: both in words (``OpenVINO bf16``).
        path: its file (``NAME.onnx``, ``NAME.int8.onnx`` or ``NAME.xml``).
        files: every file it wrote or kept, with its size in bytes.
        file_size: bytes of its files together.
        compute: for OpenVINO, the ``INFERENCE_PRECISION_HINT`` to compile it with.
        threads, batch_size: what every candidate was timed at.
        baseline: the unpruned model's FP32 file in ONNX Runtime, timed with them (a Latency dict).
        speedup: the baseline's median / the chosen deployment's.
        candidates: every candidate, simplest first.
        load_avg_1min: the 1-minute load average before and after the timing.
        notes: plain-language lines for the report, led by what was chosen.
    """

    runtime: str
    precision: str
    label: str
    path: str
    files: dict[str, int]
    file_size: int
    compute: str | None
    threads: int
    batch_size: int
    baseline: dict[str, Any]
    speedup: float
    candidates: list[dict[str, Any]]
    load_avg_1min: list[float]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_deployment(fp32_path: str | os.PathLike, settings: DeploySettings, *, input_shape: tuple[int, ...],
                      baseline: str | os.PathLike | None = None, timer: Timer | None = None) -> DeployResult:
    """Build, check and time every candidate deployment of ``fp32_path``; write the fastest beside it.

    Args:
        fp32_path: the verified FP32 ONNX file (``NAME.onnx``); the chosen deployment is written beside it
            (``NAME.int8.onnx``, or ``NAME.xml`` + ``NAME.bin``), or is the file itself.
        settings: the choice's settings (thread count, batch, candidates, task check).
        input_shape: the model input shape, batch first.
        baseline: the unpruned model's FP32 ONNX file the speed-ups are measured against (default: ``fp32_path``).
        timer: times deployments interleaved (default: :func:`optkit.analysis.latency.interleaved_latency` at
            ``settings.threads`` and ``settings.batch``); tests inject one so they never time anything.

    Returns:
        the :class:`DeployResult`.

    Raises:
        ExportError: if ``fp32_path`` is missing or no candidate passes its checks.
    """
    from optkit.analysis.latency import Deployment

    source = Path(fp32_path)
    if not source.is_file():
        raise ExportError(f"{source} not found; export the model first (optkit export MODEL --onnx {source})")
    threads = settings.threads or os.cpu_count() or 1
    shape = (settings.batch, *tuple(input_shape)[1:])
    scratch = Path(tempfile.mkdtemp(prefix=f".{source.name}.", suffix=".deploy", dir=source.parent))
    try:
        candidates = [_build(name, source, scratch, settings, tuple(input_shape), threads)
                      for name in settings.candidates or CANDIDATES]
        ready = [c for c in candidates if c.status == "verified"]
        if not ready:
            reasons = "; ".join(f"{c.name}: {c.reason}" for c in candidates)
            raise ExportError(f"no deployment passed its checks ({reasons}); nothing was written")
        load_start = os.getloadavg()[0]
        timed = list((timer or _default_timer(shape, threads, settings.repeats))(
            [Deployment(baseline or source), *(Deployment(c.built, c.runtime, c.precision) for c in ready)]))
        reference = timed[0]
        for candidate, latency in zip(ready, timed[1:]):
            candidate.latency = latency.to_dict()
            candidate.speedup = round(reference.median_ms / latency.median_ms, 3) if latency.median_ms else None
        chosen = pick(ready, settings.min_gain)
        files = _publish(chosen, source)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    notes = _notes(chosen, candidates, reference, threads, settings.batch, baseline is not None)
    return DeployResult(chosen.runtime, chosen.precision, chosen.label, next(iter(files)), files, sum(files.values()),
                        ov.compute_hint(chosen.precision) if chosen.runtime == "openvino" else None, threads,
                        settings.batch, reference.to_dict(), chosen.speedup, [c.to_dict() for c in candidates],
                        load, notes)


def pick(candidates: Sequence[Candidate], min_gain: float) -> Candidate:
    """The deployment to keep among timed, verified ``candidates`` (simplest first), marking the others.

    Each candidate must measure at least ``min_gain`` faster than the one kept before it to replace it, so
    the one kept is never slower than a simpler verified one (and lower precision or another runtime is
    taken only for a measured gain). The others get ``status`` ``verified`` or ``refused`` and a reason.

    Returns:
        the chosen candidate (``status`` ``chosen``).
    """
    kept = candidates[0]
    for candidate in candidates[1:]:
        ms, best = candidate.latency["median_ms"], kept.latency["median_ms"]
        if ms * (1 + min_gain) <= best:
            kept.reason = f"{candidate.name} measured faster ({ms:.2f} ms against {best:.2f})"
            kept = candidate
            continue
        candidate.status = "refused"
        candidate.reason = (f"slower than {kept.name} ({ms:.2f} ms against {best:.2f})" if ms >= best else
                            f"not {min_gain:.0%} faster than {kept.name} ({ms:.2f} ms against {best:.2f})")
    kept.status, kept.reason = "chosen", None
    return kept


def _build(name: str, source: Path, scratch: Path, settings: DeploySettings, shape: tuple[int, ...],
           threads: int) -> Candidate:
    """One candidate, built in ``scratch`` and checked; a failed check or a missing runtime becomes its reason."""
    from optkit.passes.quantize import quantize_onnx

    runtime, precision = name.split("-")
    candidate = Candidate(name, runtime, precision)
    if name == "onnxruntime-fp32":
        candidate.built = source
        candidate.check = {"file_size": source.stat().st_size, "verified": "against PyTorch when it was exported"}
        return candidate
    if runtime == "openvino" and (reason := ov.unavailable(precision)) is not None:
        candidate.status, candidate.reason = "unavailable", reason
        return candidate
    try:
        if runtime == "onnxruntime":
            candidate.built = scratch / source.with_suffix(".int8.onnx").name
            result = quantize_onnx(source, candidate.built, settings.int8_settings(timing_threads=threads),
                                   input_shape=shape)
            candidate.check = _check_words(result.agreement, result.accuracy_fp32, result.accuracy_int8,
                                           result.int8_size, result.checked_on)
        else:
            candidate.built = scratch / f"{source.stem}-{precision}.xml"
            result = openvino_ir(source, candidate.built, precision, settings, input_shape=shape)
            candidate.check = _check_words(result.agreement, result.accuracy_fp32, result.accuracy,
                                           result.file_size, result.checked_on)
    except (ExportError, DataError) as e:
        candidate.status, candidate.reason, candidate.built = "refused", str(e), None
    return candidate


def _check_words(agreement: float, accuracy_fp32: float | None, accuracy: float | None, size: int,
                 checked_on: str) -> dict[str, Any]:
    return {"agreement": agreement, "accuracy_fp32": accuracy_fp32, "accuracy": accuracy, "file_size": size,
            "checked_on": checked_on}


def _default_timer(shape: tuple[int, ...], threads: int, repeats: int) -> Timer:
    def timer(deployments: Sequence[Any]) -> Sequence[Any]:
        from optkit.analysis.latency import interleaved_latency

        return interleaved_latency(deployments, shape, threads=threads, warmup=3, repeats=repeats)

    return timer


def _publish(chosen: Candidate, source: Path) -> dict[str, int]:
    """Move the chosen deployment's files beside ``source`` (none for the FP32 file itself); their sizes by name."""
    if chosen.name == "onnxruntime-fp32":
        return {source.name: source.stat().st_size}
    if chosen.runtime == "onnxruntime":
        target = source.with_suffix(".int8.onnx")
        with open(chosen.built, "rb") as f:
            os.fsync(f.fileno())
        os.replace(chosen.built, target)
        return {target.name: target.stat().st_size}
    target = source.with_suffix(".xml")
    ir.publish(chosen.built, target)
    return {path.name: path.stat().st_size for path in ir.ir_files(target)}


def _notes(chosen: Candidate, candidates: list[Candidate], reference: Any, threads: int, batch: int,
           unpruned: bool) -> list[str]:
    """The choice in words: what was chosen and how fast, then each other candidate's figures or reason."""
    against = "the unpruned model's" if unpruned else "the"
    setting = f"{threads} thread(s), batch {batch}"
    how = (f", compiled with INFERENCE_PRECISION_HINT {ov.compute_hint(chosen.precision)}"
           if chosen.runtime == "openvino" else "")
    lines = [f"deployment: {chosen.label}{how} is the fastest that passed its checks at {setting}: "
             f"{chosen.latency['median_ms']:.2f} ms, {chosen.speedup:.2f}x {against} ONNX Runtime FP32 file "
             f"({reference.median_ms:.2f} ms)"]
    for candidate in candidates:
        if candidate is chosen:
            continue
        timing = (f"{candidate.latency['median_ms']:.2f} ms ({candidate.speedup:.2f}x)"
                  if candidate.latency is not None else "not timed")
        lines.append(f"deployment candidate {candidate.label}: {timing}; {candidate.status}: {candidate.reason}")
    if any(c.runtime == "openvino" and c.status == "unavailable" for c in candidates) and not ov.available():
        lines.append(ov.MISSING_NOTE)
    return lines
