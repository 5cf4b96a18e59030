"""Device passes: move the model to an accelerator, and switch convolutions to channels-last.

``to_device`` picks CUDA, then Apple's MPS, then the CPU when asked for
``auto``; an explicit device that is not there is an error, not a silent
fallback. ``channels_last`` stores 4-D weights as NHWC, the layout cuDNN's and
oneDNN's fastest convolution kernels use; whether it helps on a given machine
is measured in ``benchmarks/throughput.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optkit.core.errors import OptkitError
from optkit.core.contract import Pass, PassResult, Stage
from optkit.core.registry import register_pass
from optkit.core.settings import check_device, shared_setting

if TYPE_CHECKING:
    import torch
    from torch import nn

def resolve_device(name: str | None = "auto") -> torch.device:
    """The ``torch.device`` for a device name, checking that it is present.

    Args:
        name: ``auto`` (or ``None``): this process's CUDA GPU if CUDA is available
            (``cuda:LOCAL_RANK``, so each ``torchrun`` worker gets its own; ``cuda:0``
            outside ``torchrun``), then MPS, then CPU; or an explicit ``cpu``,
            ``cuda``, ``cuda:N``, ``mps``.

    Returns:
        the device.

    Raises:
        ValueError: for a malformed name.
        OptkitError: for a device this machine does not have.
    """
    import os

    import torch

    name = check_device(name) or "auto"
    if name == "auto":
        if torch.cuda.is_available():
            name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        elif torch.backends.mps.is_available():
            return torch.device("mps")
        else:
            return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise OptkitError(f"device {name!r} requested but no CUDA GPU is available; use --device cpu or auto")
        if device.index is not None and device.index >= count:
            raise OptkitError(f"device {name!r} requested but only {count} CUDA GPU(s) exist "
                              f"(cuda:0 to cuda:{count - 1}); use a lower index, or start fewer processes "
                              "per node than there are GPUs")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise OptkitError("device 'mps' requested but Apple MPS is not available; use --device cpu or auto")
    return device


@register_pass
@dataclass(frozen=True)
class ToDevice(Pass):
    """Move parameters and buffers to a device (auto: CUDA, then MPS, then CPU).

    An unset device takes the pipeline's, and ``auto`` when that is unset too.
    Works in place (``nn.Module.to``).
    """

    name = "to_device"
    stage = Stage.DEVICE
    device: str | None = shared_setting("device", help="Move the model to this device first (auto: CUDA, then "
                                        "MPS, then CPU).", enables=True)

    def apply(self, model: nn.Module) -> PassResult:
        device = resolve_device(self.device)
        model.to(device)
        return PassResult(model, {"device": str(device)})


@register_pass
@dataclass(frozen=True)
class ChannelsLast(Pass):
    """Store 4-D weights channels-last (NHWC), the layout of the fastest conv kernels.

    Feed channels-last inputs too (``x.to(memory_format=torch.channels_last)``)
    to avoid layout conversions at the first convolution. Works in place.
    """

    name = "channels_last"
    stage = Stage.LAYOUT
    flag = "channels-last"

    def apply(self, model: nn.Module) -> PassResult:
        import torch

        model.to(memory_format=torch.channels_last)
        converted = sum(1 for t in (*model.parameters(), *model.buffers()) if t.dim() == 4)
        return PassResult(model, {"tensors_converted": converted})
