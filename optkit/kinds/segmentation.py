"""Semantic segmentation: an image batch ``N,C,H,W`` in, per-pixel class scores (``{"out": N,K,H,W}``) out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optkit.kinds.base import ModelInputs, ModelKind
from optkit.kinds.image import DEFAULT_IMAGE_SIZE, input_channels, random_images

if TYPE_CHECKING:
    from torch import nn

#: The sub-module holding the feature extractor; its outputs feed the heads, so they keep their width.
BACKBONE = "backbone"


class Segmentation(ModelKind):
    """Encoder-head segmentation models such as torchvision's FCN, DeepLabV3 and LR-ASPP.

    Recognised by structure: a ``backbone`` child that returns a dict of
    feature maps (torchvision's ``IntermediateLayerGetter``) and no detection
    transform. Structured pruning works inside the backbone; the features it
    hands to the segmentation heads keep their width, so the heads are untouched.
    """

    name = "segmentation"
    description = "segmentation models: image batch N,C,H,W in, per-pixel scores out"
    priority = 20

    def matches(self, model: nn.Module) -> bool:
        from torchvision.models._utils import IntermediateLayerGetter

        from optkit.kinds.detection import has_detection_transform

        backbone = getattr(model, BACKBONE, None)
        return isinstance(backbone, IntermediateLayerGetter) and not has_detection_transform(model)

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        return (1, input_channels(model) or 3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        return ModelInputs((random_images(model, shape, seed=seed),))

    def prune_root(self, model: nn.Module) -> str | None:
        return BACKBONE
