"""The example plugin's pass, declared the way optkit's own passes are (torch is imported only when it runs)."""

from __future__ import annotations

from dataclasses import dataclass

from optkit.core.contract import Pass, PassResult
from optkit.core.settings import setting


@dataclass(frozen=True)
class ClampWeights(Pass):
    """Clamp every conv/linear weight to [-limit, limit].

    Works in place.
    """

    name = "clamp_weights"
    limit: float = setting(0.05, help="Largest magnitude a weight may keep.", low=0, low_open=True)

    def apply(self, model):
        import torch
        from torch import nn

        clamped = 0
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Conv2d, nn.Linear)):
                    clamped += int((module.weight.abs() > self.limit).sum())
                    module.weight.clamp_(-self.limit, self.limit)
        return PassResult(model, {"clamped_weights": clamped})
