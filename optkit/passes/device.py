"""Device passes: move the model to an accelerator, and switch convolutions to channels-last.

``to_device`` picks CUDA, then Apple's MPS, then the CPU when asked for
``auto``; an explicit device that is not there is an error, not a silent
fallback. ``channels_last`` stores 4-D weights as NHWC, the layout cuDNN's and
oneDNN's fastest convolution kernels use; whether it helps on a given machine
is measured in ``benchmarks/throughput.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optkit.errors import OptkitError
from optkit.passes.base import Pass, PassResult

if TYPE_CHECKING:
    import torch
    from torch import nn

_DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


def check_device(value: str | None) -> str | None:
    """Validate a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``); ``None`` passes through.

    Raises:
        ValueError: naming the valid choices.
    """
    if value is not None and not (isinstance(value, str) and _DEVICE_PATTERN.fullmatch(value)):
        raise ValueError(f"device must be one of {DEVICE_CHOICES}; got {value!r}")
    return value


def resolve_device(name: str | None = "auto") -> torch.device:
    """The ``torch.device`` for a device name, checking that it is present.

    Args:
        name: ``auto`` (or ``None``): CUDA if available, then MPS, then CPU;
            or an explicit ``cpu``, ``cuda``, ``cuda:N``, ``mps``.

    Returns:
        the device.

    Raises:
        ValueError: for a malformed name.
        OptkitError: for a device this machine does not have.
    """
    import torch

    name = check_device(name) or "auto"
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise OptkitError(f"device {name!r} requested but no CUDA GPU is available; use --device cpu or auto")
        if device.index is not None and device.index >= count:
            raise OptkitError(f"device {name!r} requested but only {count} CUDA GPU(s) exist "
                              f"(cuda:0 to cuda:{count - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise OptkitError("device 'mps' requested but Apple MPS is not available; use --device cpu or auto")
    return device


@dataclass(frozen=True)
class ToDevice(Pass):
    """Move parameters and buffers to a device (auto: CUDA, then MPS, then CPU).

    Args:
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; unset takes
            the pipeline's device, and ``auto`` when that is unset too.

    Works in place (``nn.Module.to``).
    """

    name = "to_device"
    device: str | None = None

    def __post_init__(self):
        check_device(self.device)

    def apply(self, model: nn.Module) -> PassResult:
        device = resolve_device(self.device)
        model.to(device)
        return PassResult(model, {"device": str(device)})


@dataclass(frozen=True)
class ChannelsLast(Pass):
    """Store 4-D weights channels-last (NHWC), the layout of the fastest conv kernels.

    Feed channels-last inputs too (``x.to(memory_format=torch.channels_last)``)
    to avoid layout conversions at the first convolution. Works in place.
    """

    name = "channels_last"

    def apply(self, model: nn.Module) -> PassResult:
        import torch

        model.to(memory_format=torch.channels_last)
        converted = sum(1 for t in (*model.parameters(), *model.buffers()) if t.dim() == 4)
        return PassResult(model, {"tensors_converted": converted})
