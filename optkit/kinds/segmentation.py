"""Semantic segmentation: an image batch ``N,C,H,W`` in, per-pixel class scores (``{"out": N,K,H,W}``) out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optkit.kinds.base import ModelInputs, ModelKind
from optkit.kinds.image import DEFAULT_IMAGE_SIZE, input_channels, random_images

if TYPE_CHECKING:
    import torch
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


#: Mask value of pixels that are not scored (the void label of VOC-style masks).
IGNORE_INDEX = 255


def mean_iou(predicted: torch.Tensor, target: torch.Tensor, num_classes: int, *,
             ignore_index: int = IGNORE_INDEX) -> dict[str, float]:
    """Mean intersection-over-union and pixel accuracy of predicted class maps against target masks.

    IoU of a class is ``TP / (TP + FP + FN)`` over every scored pixel of the
    batch; the mean is over the classes that occur in the prediction or the
    target (a class absent from both says nothing about the model).

    Args:
        predicted: ``N×H×W`` class indices (the arg-max of the model's scores).
        target: ``N×H×W`` class indices; pixels equal to ``ignore_index`` are not scored.
        num_classes: classes the masks use (``0 .. num_classes - 1``).
        ignore_index: the mask value of unscored pixels.

    Returns:
        ``{"miou", "pixel_accuracy"}``, each between 0 and 1.

    Raises:
        ValueError: for shapes that differ, no scored pixel, or a label outside the class range.
    """
    import torch

    if predicted.shape != target.shape:
        raise ValueError(f"predicted and target masks differ in shape: {tuple(predicted.shape)} and "
                         f"{tuple(target.shape)}")
    scored = target != ignore_index
    truth, guess = target[scored].long(), predicted[scored].long()
    if truth.numel() == 0:
        raise ValueError("no pixel of the masks is scored: every one is the ignored label")
    if int(truth.min()) < 0 or int(truth.max()) >= num_classes or int(guess.min()) < 0 \
            or int(guess.max()) >= num_classes:
        raise ValueError(f"a mask holds a label outside 0..{num_classes - 1} (other than {ignore_index})")
    confusion = torch.bincount(truth * num_classes + guess, minlength=num_classes ** 2).reshape(num_classes,
                                                                                                num_classes)
    hits = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - hits
    present = union > 0
    return {"miou": float((hits[present] / union[present]).mean()),
            "pixel_accuracy": float(hits.sum() / confusion.sum())}
