"""An out-of-tree model kind in one module: audio models taking float waveforms ``N,T``, registered with
``@register_kind`` when this module is imported (an installed package would name it by entry point instead).

Everything optkit decides about these models comes from the kind: the example inputs, the exported
graph's input name and dynamic axes (the batch and the waveform's length), what a shape error says,
and the unit reports count throughput in (audio samples per second). ``ConvWaveNet`` is a small
model of this kind.
"""

from __future__ import annotations

import torch
from torch import nn

from optkit.core.errors import OptkitError
from optkit.kinds import ModelInputs, ModelKind, Throughput, model_device, register_kind


@register_kind
class Waveform(ModelKind):
    """Audio models taking a float waveform batch ``N,T`` (``T`` samples each); never inferred, named with --kind."""

    name = "waveform"
    description = "audio models taking float waveforms N,T (batch, samples)"
    priority = 80
    shape_help = "N,T (batch, samples)"
    throughput_unit = "samples"

    def default_shape(self, model):
        return (1, 16_000)

    def check_shape(self, model, shape):
        if len(shape) != 2:
            raise OptkitError(f"a waveform model takes N,T (batch, samples), not {','.join(map(str, shape))}; "
                              "set --input-shape N,T")

    def shape_hint(self, model):
        return "set --input-shape N,T"

    def example_inputs(self, model, shape, *, seed=0):
        self.check_shape(model, shape)
        generator = torch.Generator().manual_seed(seed)
        return ModelInputs((torch.randn(*shape, generator=generator).to(model_device(model)),), {}, ("waveform",))

    def throughput(self, shape):
        samples = int(shape[0]) * int(shape[1])
        return Throughput(samples, self.throughput_unit, f"{samples} audio samples a call")

    def dynamic_axes(self, inputs, outputs):
        axes = {name: {0: "batch", 1: "time"} for name in inputs.names}
        for name, output in zip(self.output_names(len(outputs)), outputs):
            axes[name] = {0: "batch", **({output.dim() - 1: "frames"} if output.dim() >= 3 else {})}
        return axes


class ConvWaveNet(nn.Module):
    """Strided 1-D convolutions over a waveform ``N,T``, averaged over time, then class scores ``N,K``."""

    def __init__(self, channels: int = 32, num_classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 9, stride=2, padding=4), nn.BatchNorm1d(channels), nn.ReLU(),
            nn.Conv1d(channels, channels, 9, stride=2, padding=4), nn.BatchNorm1d(channels), nn.ReLU(),
            nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(channels, num_classes)

    def forward(self, waveform):
        return self.head(self.features(waveform.unsqueeze(1)).mean(dim=-1))
