"""Image classifiers: one float image batch ``N,C,H,W`` in, logits out (optkit's original kind)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optkit.kinds.base import ModelInputs, ModelKind, model_device

if TYPE_CHECKING:
    from torch import nn

DEFAULT_IMAGE_SIZE = 224


class ImageClassifier(ModelKind):
    """Any model taking one float tensor: an image batch ``N,C,H,W`` (or features ``N,F``).

    The fallback kind: a model no other kind recognises is treated as one.
    Its output tensors are compared as they are; the layers that write the
    model's outputs (the classifier) keep their width.
    """

    name = "image_classifier"
    description = "models taking one float tensor, such as an image batch N,C,H,W"
    priority = 100

    def matches(self, model: nn.Module) -> bool:
        return True

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        channels = input_channels(model)
        return (1, channels or 3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        return ModelInputs((random_images(model, shape, seed=seed),))


def random_images(model: nn.Module, shape: tuple[int, ...], *, seed: int = 0):
    """A reproducible standard-normal float tensor of ``shape`` on the model's device."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(model_device(model))


def input_channels(model: nn.Module) -> int | None:
    """The input channels of the model's first 2-D convolution, or ``None`` without one."""
    from torch import nn

    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return first_conv.in_channels if first_conv is not None else None
