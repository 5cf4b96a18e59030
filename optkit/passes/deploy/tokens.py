"""Deployment candidates of a language model: built with its decode graph, checked by perplexity, timed in tokens/s.

A language model is deployed as two files: ``NAME.onnx`` (a whole sequence:
the prefill) and ``NAME.decode.onnx`` (one step with a KV cache, see
:mod:`optkit.export.decode`). Each candidate of
:data:`optkit.passes.deploy.settings.TOKEN_CANDIDATES` turns both into its
runtime and precision:

* ``onnxruntime-fp32``: the exported files themselves;
* ``onnxruntime-int8``: dynamic INT8 (:func:`optkit.passes.quantize.tokens.quantize_tokens`, with its exclusion
  search);
* ``onnxruntime-w8`` / ``onnxruntime-w4``: weight-only INT8/INT4, ONNX Runtime's block-quantized ``MatMulNBits``
  (:func:`optkit.passes.quantize.weights.quantize_weights`);
* ``openvino-fp32`` / ``openvino-bf16``: OpenVINO IR computing in f32 / bf16;
* ``openvino-w8`` / ``openvino-w4``: OpenVINO IR with NNCF's weight compression (INT8_ASYM; INT4_SYM or
  INT4_ASYM in groups).

Every candidate is checked like the INT8 step checks a language model
(:func:`optkit.passes.quantize.tokens.token_check`): its validation perplexity on
the ``val`` split of the text may be at most its precision's limit times the
FP32 ONNX file's (:func:`perplexity_limit`), and its decode graph, fed the text
through its KV cache, must meet the same limit over those steps. Without text,
only the FP32 candidates are checked (top-1 agreement on random token ids),
unless ``random_calibration`` allows the others for timing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError, ExportError
from optkit.export import decode as decoding
from optkit.export import openvino as ir
from optkit.runtime import openvino as ov

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.deploy.candidate import Candidate
    from optkit.passes.deploy.settings import DeploySettings
    from optkit.passes.quantize.tokens import TokenCheck

#: The largest validation perplexity of a deployment, as a multiple of the FP32 ONNX file's, by what it computes
#: in: FP32 in another runtime differs by rounding only, bf16 by its 8-bit mantissa, INT8 (dynamic or weight-only)
#: and INT4 weights by their quantization.
FP32_PERPLEXITY_LIMIT = 1.01
BF16_PERPLEXITY_LIMIT = 1.01
INT8_PERPLEXITY_LIMIT = 1.02
INT4_PERPLEXITY_LIMIT = 1.05
#: Rounds of the default decode timing (:func:`decode_timer`): each times every decode graph once, 32 steps.
DECODE_ROUNDS = 5
NO_TEXT = ("a language model's {precision} deployment is verified by its perplexity on text: give --calib-data text "
           "(the Python documentation) or text:FILE|DIR; --random-calibration checks top-1 agreement on random token "
           "ids instead, for timing only")


def perplexity_limit(precision: str) -> float:
    """The perplexity limit of a deployment computing in ``precision`` (read when called)."""
    return {"fp32": FP32_PERPLEXITY_LIMIT, "bf16": BF16_PERPLEXITY_LIMIT, "int8": INT8_PERPLEXITY_LIMIT,
            "w8": INT8_PERPLEXITY_LIMIT, "w4": INT4_PERPLEXITY_LIMIT}[precision]


def limits() -> dict[str, float]:
    """Every precision's perplexity limit, as the report states them."""
    return {precision: perplexity_limit(precision) for precision in ("fp32", "bf16", "int8", "w8", "w4")}


def deployed_paths(source: Path, runtime: str, precision: str) -> tuple[Path, Path]:
    """Where a deployment of ``NAME.onnx`` and of its decode graph go: the files themselves for ONNX Runtime
    FP32, ``NAME.PRECISION.onnx`` and ``NAME.decode.PRECISION.onnx`` for ONNX Runtime's others, ``NAME.xml``
    and ``NAME.decode.xml`` (each with its ``.bin``) for OpenVINO."""
    step = decoding.decode_path(source)
    if runtime == "openvino":
        return source.with_suffix(".xml"), step.with_suffix(".xml")
    if precision == "fp32":
        return source, step
    return (source.with_suffix(f".{precision}.onnx"),
            step.with_name(step.name.removesuffix(".onnx") + f".{precision}.onnx"))


class TokenCandidates:
    """Builds and checks the candidates of one language model's files in a scratch folder.

    Args:
        source: the FP32 ONNX file (its decode graph, when beside it, is deployed with it).
        scratch: where candidates are built.
        settings: the deployment's settings (data, limits of agreement, INT4 scheme).
        input_shape: the token input shape ``N,L``.
        model: the PyTorch model the file was exported from.
    """

    def __init__(self, source: Path, scratch: Path, settings: DeploySettings, input_shape: tuple[int, ...],
                 model: nn.Module):
        self.source, self.scratch, self.settings, self.shape, self.model = source, scratch, settings, input_shape, model
        step = decoding.decode_path(source)
        self.decode_source = step if step.is_file() else None
        self._check: TokenCheck | DataError | None = None

    def int8_settings(self, limit: float | None = None):
        """The INT8 settings the checks run with: the deployment's data, and ``limit`` (default: INT8's) as the
        largest perplexity increase (at least 0, which the settings require; :meth:`_judge` applies the limit
        itself)."""
        limit = perplexity_limit("int8") if limit is None else limit
        return self.settings.int8_settings(max_perplexity_increase=max(limit - 1, 0.0))

    def check(self, precision: str) -> TokenCheck:
        """The check of the FP32 file, made once: on text, else on random token ids (FP32 candidates always;
        others only with ``random_calibration``).

        Raises:
            DataError: without text for a candidate that needs it, or text the model cannot read.
        """
        from optkit.passes.quantize.tokens import token_check

        if self._check is None:
            try:
                self._check = token_check(self.source, self.model, self.shape, self.int8_settings(), random=True)
            except DataError as e:
                self._check = e
        if isinstance(self._check, DataError):
            raise self._check
        if not self._check.perplexity and precision != "fp32" and not self.settings.random_calibration:
            raise DataError(NO_TEXT.format(precision=precision))
        return self._check

    def build(self, candidate: Candidate) -> None:
        """Build ``candidate``'s files in the scratch folder and check them, filling in its ``built``,
        ``decode_built`` and ``check``.

        Raises:
            ExportError, DataError: the candidate cannot be built or misses its check.
        """
        runtime, precision = candidate.runtime, candidate.precision
        if (runtime, precision) == ("onnxruntime", "fp32"):
            candidate.built, candidate.decode_built = self.source, self.decode_source
            candidate.check = {"verified": "against PyTorch when it was exported", "perplexity_ratio": 1.0,
                               "limit": perplexity_limit("fp32"), **self._sizes(self.source, self.decode_source)}
            return
        check = self.check(precision)
        if (runtime, precision) == ("onnxruntime", "int8"):
            main, step, figures = self._dynamic_int8(check)
        else:
            main, step = self._files(runtime, precision)
            figures = self._figures(precision, check, main, step)
        candidate.built, candidate.decode_built = main, step
        candidate.check = {**figures, **self._sizes(main, step)}
        self._judge(candidate.label, precision, check, candidate.check)

    def _files(self, runtime: str, precision: str) -> tuple[Path, Path | None]:
        """The candidate's main file and decode graph (``None`` without one), written in the scratch folder."""
        from optkit.passes.quantize.weights import quantize_weights

        sources = [self.source] + ([self.decode_source] if self.decode_source is not None else [])
        made = []
        for index, source in enumerate(sources):
            name = "model" if index == 0 else "model.decode"
            if runtime == "onnxruntime":
                target = self.scratch / f"{name}.{precision}.onnx"
                quantize_weights(source, target, 8 if precision == "w8" else 4,
                                 block_size=self.settings.weight_block_size,
                                 symmetric=self.settings.int4_scheme == "sym" or precision == "w8")
            else:
                target = self.scratch / f"{name}-{precision}.xml"
                model = ov.read(source)
                if precision in ov.WEIGHT_PRECISIONS:
                    model = ir.compress_weights(model, 8 if precision == "w8" else 4,
                                                group_size=self.settings.weight_block_size,
                                                symmetric=self.settings.int4_scheme == "sym")
                ir.save(model, target, precision)
            made.append(target)
        return made[0], (made[1] if len(made) > 1 else None)

    def _figures(self, precision: str, check: TokenCheck, main: Path, step: Path | None) -> dict[str, Any]:
        """The candidate's figures against the FP32 file's: on the text (or random ids), and its decode graph's
        over the check's prompts."""
        from optkit.passes.quantize.tokens import decode_figures

        figures, missed = check.run(main, perplexity_limit(precision) - 1)
        found = {"checked_on": check.source, "limit": perplexity_limit(precision),
                 "agreement": figures.get("agreement"), "perplexity_fp32": check.base.get("perplexity"),
                 "perplexity": figures.get("perplexity"), "accuracy": figures.get("accuracy"),
                 "mean_kl": figures.get("mean_kl"), "missed": missed}
        if step is not None:
            steps, missed = decode_figures(self.decode_source, step, check,
                                           self.int8_settings(perplexity_limit(precision)))
            found["decode"] = _decode_words({**steps, "missed": missed})
        return found

    def _dynamic_int8(self, check: TokenCheck) -> tuple[Path, Path | None, dict[str, Any]]:
        """Dynamic INT8 of both files, as the ``int8`` step makes it (its exclusion search included), and its
        figures."""
        from optkit.passes.quantize.tokens import quantize_tokens

        target = self.scratch / "model.int8.onnx"
        result = quantize_tokens(self.source, target, self.int8_settings(), model=self.model, input_shape=self.shape,
                                 check=check)
        info = result.decode
        step = target.with_name(info["file"]) if info is not None and info["file"] is not None else None
        found = {"checked_on": result.checked_on, "limit": perplexity_limit("int8"), "agreement": result.agreement,
                 "perplexity_fp32": result.perplexity_fp32, "perplexity": result.perplexity_int8,
                 "accuracy": result.accuracy_int8, "mean_kl": result.mean_kl,
                 "excluded_nodes": result.excluded_nodes, "missed": []}
        if info is not None:
            found["decode"] = _decode_words(info)
            if step is None:
                found["missed"] = [f"decode graph: {'; '.join(info['missed'])}"]
        return target, step, found

    @staticmethod
    def _judge(label: str, precision: str, check: TokenCheck, found: dict[str, Any]) -> None:
        """Add the perplexity ratios to ``found`` and refuse a candidate past its precision's limit.

        Raises:
            ExportError: one line naming the limit and the figures that missed it.
        """
        limit = perplexity_limit(precision)
        missed = list(found.pop("missed"))
        if found.get("perplexity") is not None:
            found["perplexity_ratio"] = found["perplexity"] / found["perplexity_fp32"]
            missed = [m for m in missed if not m.startswith("perplexity ")]
            if found["perplexity_ratio"] > limit:
                missed.insert(0, f"validation perplexity {found['perplexity']:.4f} is {found['perplexity_ratio']:.4f}x "
                                 f"FP32's {found['perplexity_fp32']:.4f}")
        decode = found.get("decode") or {}
        if decode.get("perplexity_ratio") is not None and decode["perplexity_ratio"] > limit:
            missed.append(f"its decode graph's perplexity over {decode['steps']} steps is "
                          f"{decode['perplexity_ratio']:.4f}x FP32's")
        elif decode.get("perplexity_ratio") is None and decode.get("missed"):
            missed.append(f"decode graph: {'; '.join(decode['missed'])}")
        if missed:
            what = f"its limit of {limit:g}x the FP32 perplexity" if check.perplexity else "its check"
            raise ExportError(f"{label} missed {what} on {check.source}: {'; '.join(missed)}; nothing was written")

    @staticmethod
    def _sizes(main: Path, step: Path | None) -> dict[str, Any]:
        sizes = _sizes(main, step)
        return {"file_size": sum(sizes.values()), "files": sizes}


def _decode_words(figures: dict[str, Any]) -> dict[str, Any]:
    """A decode check's figures for the report: steps, agreement, greedy match, perplexities and their ratio."""
    found = {k: figures[k] for k in ("prompts", "steps", "agreement", "greedy_match", "perplexity_fp32",
                                     "perplexity_int8", "missed") if k in figures}
    if found.get("perplexity_fp32"):
        found["perplexity"] = found.pop("perplexity_int8")
        found["perplexity_ratio"] = found["perplexity"] / found["perplexity_fp32"]
    return found


def _files_of(path: Path) -> list[Path]:
    """A deployment file and what it reads beside it: an IR's ``.bin``, an ONNX file's external data."""
    if path.suffix == ".xml":
        return ir.ir_files(path)
    return [path, *path.parent.glob(f"{path.name}.data")]


def _sizes(*paths: Path | None) -> dict[str, int]:
    return {file.name: file.stat().st_size for path in paths if path is not None for file in _files_of(path)}


def time_tokens(ready: list[Candidate], baseline: Path, shape: tuple[int, ...], threads: int, repeats: int,
                timer: Any, decode_timer: Any, model: nn.Module) -> dict[str, Any]:
    """Time the verified candidates against the unpruned FP32 files: the prefill of ``shape`` through ``timer``
    (interleaved blocks), and, when every one has a decode graph, the decode step through ``decode_timer``
    (tokens/s of ``shape[0]`` rows decoding together after a prompt). The choice compares the decode step's
    time when it was timed, else the prefill's; each candidate's ``latency`` is that measure and ``prefill`` its
    prefill figures.

    Returns:
        the baseline's figures: ``{"timed_as": "decode" | "prefill", "latency", "prefill"}``.
    """
    from optkit.analysis.latency import Deployment
    from optkit.kinds.tokens import max_positions

    tokens = shape[0] * shape[1]
    prefill = list(timer([Deployment(baseline), *(Deployment(c.built, c.runtime, c.precision) for c in ready)]))
    prefill_dicts = [{**latency.to_dict(), "tokens_per_s": round(tokens * 1000.0 / latency.median_ms, 1)}
                     for latency in prefill]
    for candidate, figures in zip(ready, prefill_dicts[1:]):
        candidate.prefill = figures
    step = decoding.decode_path(baseline)
    if not step.is_file() or any(c.decode_built is None for c in ready):
        for candidate, figures in zip(ready, prefill_dicts[1:]):
            candidate.latency = figures
        return {"timed_as": "prefill", "latency": prefill_dicts[0], "prefill": prefill_dicts[0]}
    positions = max_positions(model) or decoding.PROMPT_TOKENS + decoding.DECODE_STEPS
    prompt = max(1, min(decoding.PROMPT_TOKENS, positions - decoding.DECODE_STEPS))
    speeds = list(decode_timer([step, *(c.decode_built for c in ready)], prompt_tokens=prompt, threads=threads,
                               batch=shape[0]))
    for candidate, speed in zip(ready, speeds[1:]):
        candidate.latency = speed
    return {"timed_as": "decode", "latency": speeds[0], "prefill": prefill_dicts[0], "prompt_tokens": prompt}


def decode_timer(paths: list[Path], *, prompt_tokens: int, threads: int, batch: int = 1,
                 rounds: int = DECODE_ROUNDS) -> list[dict[str, Any]]:
    """The default decode timing: :func:`optkit.export.decode.onnx_decode_speed` of one graph at a time (an IR
    runs in OpenVINO) with ``batch`` rows decoding together, the graphs taking turns for ``rounds`` rounds, each
    on a fresh session after a warm-up.

    Only one session is alive at a time, as :func:`optkit.analysis.latency.interleaved_latency` times files:
    the idle threads of other sessions (ONNX Runtime's and OpenVINO's pools) would slow the one being timed.

    Returns:
        per graph the median over rounds of each round's ``median_ms`` per step, the largest ``p90_ms``,
        ``tokens_per_s`` (``batch`` tokens a step) and the ``rounds``.
    """
    import statistics

    timed: list[list[dict[str, Any]]] = [[] for _ in paths]
    for _ in range(rounds):
        for path, runs in zip(paths, timed):
            runs += decoding.onnx_decode_speed([path], prompt_tokens=prompt_tokens, rounds=1, threads=threads,
                                               batch=batch)
    speeds = []
    for runs in timed:
        median = statistics.median(run["median_ms"] for run in runs)
        speeds.append({"median_ms": round(median, 4), "p90_ms": round(max(run["p90_ms"] for run in runs), 4),
                       "tokens_per_s": round(batch * 1e3 / median, 1), "rounds": rounds, "threads": threads,
                       "batch": batch})
    return speeds


def decode_median_ms(path: str, prompt_tokens: int, threads: int, batch: int) -> float:
    """The median ms of a decode step of one decode graph, timed alone by :func:`decode_timer` (JSON-friendly, for
    :func:`optkit.analysis.fresh.call_fresh`)."""
    return decode_timer([Path(path)], prompt_tokens=prompt_tokens, threads=threads, batch=batch)[0]["median_ms"]


def publish(candidate: Candidate, source: Path) -> dict[str, int]:
    """Move a token candidate's files beside ``source`` (nothing for the FP32 files); their sizes by name."""
    if (candidate.runtime, candidate.precision) == ("onnxruntime", "fp32"):
        return _sizes(candidate.built, candidate.decode_built)
    targets = deployed_paths(source, candidate.runtime, candidate.precision)
    written = []
    for built, target in zip((candidate.built, candidate.decode_built), targets):
        if built is None:
            continue
        if target.suffix == ".xml":
            ir.publish(built, target)
        else:
            # The external data first (its name, which the file records, is the same), so the file never names
            # data that is not there yet.
            for data in built.parent.glob(f"{built.name}.data"):
                os.replace(data, target.with_name(data.name))
            with open(built, "rb") as f:
                os.fsync(f.fileno())
            os.replace(built, target)
        written.append(target)
    return _sizes(*written)
