"""Mixed precision as a pass: wrap the model so its forward runs under ``torch.autocast``.

The wrapper (:class:`optkit.amp.AutocastModule`) returns fp32 outputs, and
checkpoints and export see through it to the unchanged inner model. The rule
behind ``dtype="auto"`` is documented in :mod:`optkit.amp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optkit.passes.base import DEFAULT_INPUT_SHAPE, Pass, PassResult, check_choice, check_input_shape

if TYPE_CHECKING:
    from torch import nn

AMP_CHOICES = ("auto", "bf16", "fp16", "off")


@dataclass(frozen=True)
class Autocast(Pass):
    """Run the forward pass under torch.autocast (fp16 on GPUs, bf16 on CPUs where it is faster).

    Args:
        dtype: ``auto``, ``bf16``, ``fp16`` or ``off`` (``off`` returns the model
            unwrapped). ``auto`` picks fp16 on CUDA/MPS; on a CPU it picks bf16
            only when the CPU has native bf16 instructions and a timed forward
            pass at ``input_shape`` is faster with it, else off.
        input_shape: example input shape for the ``auto`` measurement on CPU.

    Run it after ``to_device``: the dtype is chosen for the device the model is
    on. The inner model is not changed.
    """

    name = "autocast"
    in_place = False
    dtype: str = "auto"
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        check_choice("dtype", self.dtype, AMP_CHOICES)
        self._normalize("input_shape", check_input_shape(self.input_shape))

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.amp import AutocastModule, resolve_amp, time_forward
        from optkit.metrics import example_input, model_device

        inner = model.optkit_unwrap() if isinstance(model, AutocastModule) else model
        device = model_device(inner)

        def measure(dtype: str | None) -> float:
            was_training = inner.training
            inner.eval()
            try:
                return time_forward(inner, example_input(inner, self.input_shape or DEFAULT_INPUT_SHAPE), dtype)
            finally:
                inner.train(was_training)

        dtype, facts = resolve_amp(self.dtype, device, measure=measure)
        details = {"dtype": dtype, "device": str(device), **facts}
        if dtype == "off":
            return PassResult(inner, details)
        return PassResult(AutocastModule(inner, dtype), details)
