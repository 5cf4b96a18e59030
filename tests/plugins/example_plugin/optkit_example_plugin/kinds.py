"""An out-of-tree model kind: models that compare two images (``forward(left, right)``), registered by entry point."""

from __future__ import annotations

from optkit.kinds import ModelInputs, ModelKind, model_device


class ImagePair(ModelKind):
    """Two image batches ``N,C,H,W`` in (stereo, change detection, siamese matching); never inferred, named with --kind."""

    name = "image_pair"
    description = "models taking two image batches N,C,H,W (left, right)"
    priority = 90

    def default_shape(self, model):
        return (1, 3, 32, 32)

    def example_inputs(self, model, shape, *, seed=0):
        import torch

        generator = torch.Generator().manual_seed(seed)
        left, right = (torch.randn(*shape, generator=generator).to(model_device(model)) for _ in range(2))
        return ModelInputs((left, right), {}, ("left", "right"))

    def export_module(self, model, inputs):
        return model
