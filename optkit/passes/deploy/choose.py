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

A language model (given as ``model``) has its own candidates
(:data:`optkit.passes.deploy.settings.TOKEN_CANDIDATES`, weight-only INT8/INT4
in both runtimes among them), each deployed with its decode graph, checked by
validation perplexity against its precision's limit and timed as prefill and
decode tokens/s (:mod:`optkit.passes.deploy.tokens`); the same rule then
compares their decode time per token.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from optkit.core.errors import ExportError, OptkitError
from optkit.export import openvino as ir
from optkit.passes.deploy import tokens as token_deploy
from optkit.passes.deploy.candidate import Candidate
from optkit.passes.deploy.convert import openvino_ir
from optkit.passes.deploy.settings import CANDIDATES, TOKEN_CANDIDATES, DeploySettings
from optkit.runtime import openvino as ov

#: A timer takes the deployments to time (the baseline first) and returns each one's Latency, in order.
Timer = Callable[[Sequence[Any]], Sequence[Any]]
#: A decode timer takes decode graphs (the baseline's first), ``prompt_tokens``, ``threads`` and ``batch``, and
#: returns each one's decode speed (``median_ms`` per step, ``tokens_per_s``), in order.
DecodeTimer = Callable[..., Sequence[dict[str, Any]]]


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
        timed_as: what the choice compared: ``call`` (one call at ``batch_size``), or for a language model
            ``decode`` (time of a decode step at ``batch_size``) or ``prefill`` (without decode graphs).
        prefill_baseline: a language model's unpruned FP32 prefill timing (with ``tokens_per_s``).
        perplexity_limits: a language model's perplexity limit by precision (multiples of FP32's).
        decode_prompt_tokens: the prompt before the timed decode steps.
        min_gain: the gain over a simpler deployment a candidate needed to be chosen.
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
    timed_as: str = "call"
    prefill_baseline: dict[str, Any] | None = None
    perplexity_limits: dict[str, float] | None = None
    decode_prompt_tokens: int | None = None
    min_gain: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_deployment(fp32_path: str | os.PathLike, settings: DeploySettings, *, input_shape: tuple[int, ...],
                      baseline: str | os.PathLike | None = None, timer: Timer | None = None, model: Any = None,
                      decode_timer: DecodeTimer | None = None) -> DeployResult:
    """Build, check and time every candidate deployment of ``fp32_path``; write the fastest beside it.

    Args:
        fp32_path: the verified FP32 ONNX file (``NAME.onnx``); the chosen deployment is written beside it
            (``NAME.int8.onnx``, or ``NAME.xml`` + ``NAME.bin``), or is the file itself.
        settings: the choice's settings (thread count, batch, candidates, task check).
        input_shape: the model input shape, batch first.
        baseline: the unpruned model's FP32 ONNX file the speed-ups are measured against (default: ``fp32_path``);
            for a language model, its decode graph beside it too.
        timer: times deployments interleaved (default: :func:`optkit.analysis.latency.interleaved_latency` at
            ``settings.threads`` and ``settings.batch``); tests inject one so they never time anything.
        model: the PyTorch model the file was exported from; a language model (its kind's ``language_model``)
            gets the language-model candidates, checked by perplexity (:mod:`optkit.passes.deploy.tokens`).
        decode_timer: times a language model's decode graphs (default:
            :func:`optkit.export.decode.onnx_decode_speed` at ``settings.threads``).

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
    language = model is not None and _language_model(model)
    scratch = Path(tempfile.mkdtemp(prefix=f".{source.name}.", suffix=".deploy", dir=source.parent))
    try:
        if language:
            builder = token_deploy.TokenCandidates(source, scratch, settings, tuple(input_shape), model)
            candidates = [build_token_candidate(name, builder) for name in settings.candidates or TOKEN_CANDIDATES]
        else:
            candidates = [build_candidate(name, source, scratch, settings, tuple(input_shape), threads)
                          for name in settings.candidates or CANDIDATES]
        ready = [c for c in candidates if c.status == "verified"]
        if not ready:
            reasons = "; ".join(f"{c.name}: {c.reason}" for c in candidates)
            raise ExportError(f"no deployment passed its checks ({reasons}); nothing was written")
        load_start = os.getloadavg()[0]
        timer = timer or _default_timer(shape, threads, settings.repeats)
        if language:
            timing = token_deploy.time_tokens(ready, Path(baseline or source), shape, threads, settings.repeats, timer,
                                              decode_timer or token_deploy.decode_timer, model)
            reference = timing["latency"]
        else:
            timing = {"timed_as": "call"}
            timed = list(timer([Deployment(baseline or source),
                                *(Deployment(c.built, c.runtime, c.precision) for c in ready)]))
            reference = timed[0].to_dict()
            for candidate, latency in zip(ready, timed[1:]):
                candidate.latency = latency.to_dict()
        for candidate in ready:
            ms = candidate.latency["median_ms"]
            candidate.speedup = round(reference["median_ms"] / ms, 3) if ms else None
        chosen = pick(ready, settings.min_gain)
        files = token_deploy.publish(chosen, source) if language else _publish(chosen, source)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    notes = _notes(chosen, candidates, reference, threads, settings.batch, baseline is not None, timing["timed_as"])
    return DeployResult(chosen.runtime, chosen.precision, chosen.label, next(iter(files)), files, sum(files.values()),
                        ov.compute_hint(chosen.precision) if chosen.runtime == "openvino" else None, threads,
                        settings.batch, reference, chosen.speedup, [c.to_dict() for c in candidates],
                        load, notes, timing["timed_as"], timing.get("prefill"),
                        token_deploy.limits() if language else None, timing.get("prompt_tokens"), settings.min_gain)


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


def _language_model(model: Any) -> bool:
    from optkit.kinds import kind_of

    return kind_of(model).language_model


def build_token_candidate(name: str, builder: token_deploy.TokenCandidates) -> Candidate:
    """One candidate of a language model, built and checked by ``builder``; a failed check, a missing runtime or one
    that cannot take the model becomes its reason."""
    runtime, precision = name.split("-")
    candidate = Candidate(name, runtime, precision)
    if name not in TOKEN_CANDIDATES:
        candidate.status, candidate.reason = "unavailable", (
            f"{name} is for other models; a language model's OpenVINO INT8 is its weight compression (openvino-w8)")
        return candidate
    if runtime == "openvino" and (reason := ov.unavailable(precision)) is not None:
        candidate.status, candidate.reason = "unavailable", reason
        return candidate
    try:
        builder.build(candidate)
    except OptkitError as e:
        candidate.status, candidate.reason, candidate.built, candidate.decode_built = "refused", str(e), None, None
    return candidate


def build_candidate(name: str, source: Path, scratch: Path, settings: DeploySettings, shape: tuple[int, ...],
                    threads: int) -> Candidate:
    """Candidate ``name`` of the FP32 file ``source`` (not a language model's), built in ``scratch`` and checked on
    the task; a failed check, a missing runtime or one that cannot take the model becomes its status and reason."""
    from optkit.passes.quantize import quantize_onnx

    runtime, precision = name.split("-")
    candidate = Candidate(name, runtime, precision)
    if name not in CANDIDATES:
        candidate.status, candidate.reason = "unavailable", f"{name} is for language models (weight-only quantization)"
        return candidate
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
    except OptkitError as e:  # one candidate's failure is its refusal; the others are still built and timed
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


def _notes(chosen: Candidate, candidates: list[Candidate], reference: dict[str, Any], threads: int, batch: int,
           unpruned: bool, timed_as: str = "call") -> list[str]:
    """The choice in words: what was chosen and how fast, then each other candidate's figures or reason."""
    against = "the unpruned model's" if unpruned else "the"
    setting = f"{threads} thread(s), batch {batch}"
    unit = {"decode": " per decode step", "prefill": " per prefill"}.get(timed_as, "")
    how = (f", compiled with INFERENCE_PRECISION_HINT {ov.compute_hint(chosen.precision)}"
           if chosen.runtime == "openvino" else "")
    lines = [f"deployment: {chosen.label}{how} is the fastest that passed its checks at {setting}: "
             f"{chosen.latency['median_ms']:.2f} ms{unit}{_words(chosen)}, {chosen.speedup:.2f}x {against} ONNX "
             f"Runtime FP32 file ({reference['median_ms']:.2f} ms)"]
    for candidate in candidates:
        if candidate is chosen:
            continue
        timing = (f"{candidate.latency['median_ms']:.2f} ms{unit} ({candidate.speedup:.2f}x){_words(candidate)}"
                  if candidate.latency is not None else "not timed")
        lines.append(f"deployment candidate {candidate.label}: {timing}; {candidate.status}: {candidate.reason}")
    if any(c.runtime == "openvino" and c.status == "unavailable" for c in candidates) and not ov.available():
        lines.append(ov.MISSING_NOTE)
    return lines


def _words(candidate: Candidate) -> str:
    """A language model candidate's perplexity against its limit, and its tokens/s, in words (else nothing)."""
    ratio = candidate.check.get("perplexity_ratio")
    if ratio is None and candidate.prefill is None:
        return ""
    parts = []
    if ratio is not None:
        parts.append(f"perplexity {ratio:.4f}x FP32 (limit {candidate.check['limit']:g}x)")
    if candidate.prefill is not None:
        parts.append(f"prefill {candidate.prefill['tokens_per_s']:,.0f} tokens/s")
    if candidate.latency is not None and candidate.latency is not candidate.prefill:
        parts.append(f"decode {candidate.latency['tokens_per_s']:,.0f} tokens/s")
    return f" ({', '.join(parts)})"
