"""One deployment the choice tries (:class:`Candidate`): runtime and precision, check, timing and status."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUNTIME_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
PRECISION_WORDS = {"bf16": "bf16", "w8": "weight-only INT8", "w4": "weight-only INT4"}


@dataclass
class Candidate:
    """One deployment the choice tried.

    Attributes:
        name: ``runtime-precision`` (``openvino-bf16``).
        runtime: ``onnxruntime`` or ``openvino``.
        precision: ``fp32``, ``bf16``, ``int8``, or for a language model ``w8``/``w4`` (weight-only INT8/INT4).
        status: ``chosen``, ``verified`` (passed, not chosen), ``refused`` (missed a check, or measured no
            faster than a simpler one) or ``unavailable`` (cannot run here).
        reason: why it was not chosen (``None`` for the chosen one).
        check: what its check found (agreement, accuracy, file size; a language model's perplexity ratio and
            limit), when it was built.
        latency: what the choice compares, when it was timed: its :class:`~optkit.analysis.latency.Latency` as a
            dict, or for a language model with a decode graph its decode speed (``median_ms`` per token,
            ``tokens_per_s``).
        speedup: the unpruned FP32 file's median / its median, when it was timed.
        prefill: a language model's prefill timing (a Latency dict with ``tokens_per_s``), when it was timed.
    """

    name: str
    runtime: str
    precision: str
    status: str = "verified"
    reason: str | None = None
    check: dict[str, Any] = field(default_factory=dict)
    latency: dict[str, Any] | None = None
    speedup: float | None = None
    prefill: dict[str, Any] | None = None
    built: Path | None = field(default=None, repr=False)
    decode_built: Path | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        """``OpenVINO bf16``: the runtime and precision in words."""
        return f"{RUNTIME_NAMES[self.runtime]} {PRECISION_WORDS.get(self.precision, self.precision.upper())}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("built")
        out.pop("decode_built")
        return out
