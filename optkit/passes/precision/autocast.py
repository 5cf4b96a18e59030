"""Mixed precision: the autocast wrapper module and the rules that pick its dtype.

Two rules: training wants bf16's fp32-sized exponent range (no loss scaling),
running a model wants fp16's finer mantissa. The rule for ``auto`` when running
a model (what the ``autocast`` pass and ``--amp auto`` use, :func:`resolve_amp`):

* CUDA: float16 (every CUDA GPU runs it on tensor cores or at least natively);
* MPS: float16;
* CPU: bfloat16 only if the CPU has native bf16 dot-product instructions
  (x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16``) **and** the model's
  forward pass, timed on an example input, runs at least
  :data:`CPU_BF16_MIN_SPEEDUP` times faster under bf16 autocast than in fp32;
  otherwise off. Without native instructions bf16 is emulated and slower; with
  them it still depends on the model (small layers lose to the casts), hence
  the measurement. ``benchmarks/throughput.py`` records this measurement for
  its model next to its training and eval throughput.

The rule for ``auto`` when training (what fine-tuning and ``--train-amp auto``
use, :func:`training_dtype`): bfloat16 on a CUDA GPU that supports it, else
float16; off on CPU and MPS (an explicit ``bf16`` or ``fp16`` trains under
autocast there too).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from optkit.passes.precision.modes import AMP_CHOICES

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: bf16 must make the forward pass at least this much faster for ``auto`` to pick it on CPU.
CPU_BF16_MIN_SPEEDUP = 1.1
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class AutocastModule(nn.Module):
    """Runs the wrapped model's forward under ``torch.autocast`` and returns fp32 outputs.

    Checkpoints and export see through it (:meth:`optkit_unwrap`): they save
    and export the inner model, which is unchanged.

    Args:
        model: the model to wrap.
        dtype: ``"bf16"`` or ``"fp16"``.
    """

    def __init__(self, model: nn.Module, dtype: str):
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type = _device_type(args, kwargs, self.model)
        with torch.autocast(device_type=device_type, dtype=_DTYPES[self.dtype]):
            out = self.model(*args, **kwargs)
        return _to_float32(out)

    def optkit_unwrap(self) -> nn.Module:
        """The inner model, for checkpoints and export."""
        return self.model

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


def _device_type(args: tuple, kwargs: dict, model: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for tensor in model.parameters():
        return tensor.device.type
    return "cpu"


def _to_float32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_to_float32(v) for v in out)
    if isinstance(out, tuple):
        return type(out)(*(_to_float32(v) for v in out))
    if isinstance(out, dict):
        return {k: _to_float32(v) for k, v in out.items()}
    return out


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (read from ``/proc/cpuinfo``; False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def time_forward(model: nn.Module, example: torch.Tensor, dtype: str | None, *, repeats: int = 5) -> float:
    """Median seconds of one no-grad forward of ``model`` on ``example``, under autocast ``dtype`` (None: fp32)."""
    device_type = example.device.type
    samples = []
    with torch.no_grad(), torch.autocast(device_type, dtype=_DTYPES.get(dtype or "bf16"), enabled=dtype is not None):
        model(example)
        for _ in range(repeats):
            start = time.perf_counter()
            model(example)
            _synchronize(device_type)
            samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def _synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def resolve_amp(choice: str, device: torch.device, *, measure: Callable[[str | None], float] | None = None
                ) -> tuple[str, dict[str, Any]]:
    """The autocast dtype (``"bf16"``, ``"fp16"`` or ``"off"``) for ``choice`` on ``device``.

    Args:
        choice: ``auto``, ``bf16``, ``fp16`` or ``off``; explicit choices are returned as given.
        device: where the model runs.
        measure: for ``auto`` on a CPU with native bf16: returns the seconds of
            a forward pass given ``None`` (fp32) or ``"bf16"``; without it the
            capability check alone decides.

    Returns:
        the dtype name and the facts that decided it (for the report).

    Raises:
        ValueError: for an unknown choice.
    """
    if choice not in AMP_CHOICES:
        raise ValueError(f"amp must be one of {', '.join(AMP_CHOICES)}; got {choice!r}")
    if choice != "auto":
        return choice, {"rule": "given"}
    if device.type in ("cuda", "mps"):
        return "fp16", {"rule": f"fp16 on {device.type}"}
    if not cpu_has_native_bf16():
        return "off", {"rule": "CPU has no native bf16 instructions"}
    if measure is None:
        return "bf16", {"rule": "CPU has native bf16 instructions"}
    fp32_s, bf16_s = measure(None), measure("bf16")
    speedup = fp32_s / bf16_s if bf16_s > 0 else 0.0
    facts = {"fp32_forward_ms": round(fp32_s * 1e3, 3), "bf16_forward_ms": round(bf16_s * 1e3, 3),
             "bf16_speedup": round(speedup, 3)}
    if speedup >= CPU_BF16_MIN_SPEEDUP:
        return "bf16", {"rule": f"native bf16 and measured speedup >= {CPU_BF16_MIN_SPEEDUP}", **facts}
    return "off", {"rule": f"native bf16 but measured speedup < {CPU_BF16_MIN_SPEEDUP}", **facts}


def training_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training with ``amp`` on ``device`` (``None``: full precision).

    Args:
        amp: ``auto``, ``bf16``, ``fp16`` or ``off``; explicit choices are returned as given.
        device: where the model trains.

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``None``.

    Raises:
        ValueError: for an unknown choice.
    """
    if amp not in AMP_CHOICES:
        raise ValueError(f"amp must be one of {', '.join(AMP_CHOICES)}; got {amp!r}")
    if amp == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _DTYPES.get(amp)
