"""Mixed precision as a pass: wrap the model so its forward runs under ``torch.autocast``.

The wrapper (:class:`optkit.passes.precision.autocast.AutocastModule`) returns fp32 outputs, and
checkpoints and export see through it to the unchanged inner model. The rule
behind ``dtype="auto"`` is documented in :mod:`optkit.passes.precision.autocast`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult, Stage
from optkit.core.registry import register_pass
from optkit.core.settings import setting, shared_setting
from optkit.passes.precision.modes import AMP_CHOICES

if TYPE_CHECKING:
    from torch import nn



@register_pass
@dataclass(frozen=True)
class Autocast(Pass):
    """Run the forward pass under torch.autocast (fp16 on GPUs, bf16 on CPUs where it is faster).

    ``auto`` picks fp16 on CUDA/MPS; on a CPU it picks bf16 only when the CPU
    has native bf16 instructions and a timed forward pass at ``input_shape`` is
    faster with it, else off. Run it after ``to_device``: the dtype is chosen
    for the device the model is on. The inner model is not changed.
    """

    name = "autocast"
    in_place = False
    stage = Stage.WRAP
    dtype: str = setting("auto", help="Wrap the result in autocast: auto, bf16, fp16 or off (off leaves the model "
                         "unwrapped).", choices=AMP_CHOICES, flag="amp", enables=True)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.kinds import model_device
        from optkit.model.inputs import example_input
        from optkit.passes.precision.autocast import AutocastModule, resolve_amp, time_forward

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
