"""Semantic segmentation: an image batch ``N,C,H,W`` in, per-pixel class scores (``{"out": N,K,H,W}``) out."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError
from optkit.kinds.base import EvalData, EvalSet, ModelInputs, ModelKind, ScoreColumn, output_batches
from optkit.kinds.image import DEFAULT_IMAGE_SIZE, input_channels, random_images
from optkit.kinds.registry import register_kind

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The sub-module holding the feature extractor; its outputs feed the heads, so they keep their width.
BACKBONE = "backbone"
#: Class scores held at once while scoring (float32 values): large maps of many classes go in smaller batches.
SCORES_PER_BATCH = 2 ** 25
#: Images whose pixels are counted at once while scoring.
IMAGES_PER_COUNT = 64


@register_kind
class Segmentation(ModelKind):
    """Encoder-head segmentation models such as torchvision's FCN, DeepLabV3 and LR-ASPP.

    Recognised by structure: a ``backbone`` child that returns a dict of
    feature maps (torchvision's ``IntermediateLayerGetter``) and no detection
    transform. Structured pruning works inside the backbone; the features it
    hands to the segmentation heads keep their width, so the heads are untouched.

    Scored on a segmentation folder (``--eval segfolder:DIR``, see
    :mod:`optkit.data.segfolder`): each pixel's predicted class is the arg-max
    of the first output (``out``); mIoU and pixel accuracy count the pixels
    whose mask is not 255, and the agreement with the original is the share of
    all pixels whose predicted class is the original model's.
    """

    name = "segmentation"
    description = "segmentation models: image batch N,C,H,W in, per-pixel scores out"
    priority = 20
    throughput_unit = "images"
    score_columns = (ScoreColumn("mean_iou", "mIoU", ".2%"),
                     ScoreColumn("accuracy", "pixel accuracy", ".2%"),
                     ScoreColumn("agreement", "agreement with original", ".2%"))

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

    def eval_set(self, model: nn.Module, shape: tuple[int, ...], spec: str, *, split: str, samples: int,
                 data: EvalData) -> EvalSet:
        """Images of a segmentation folder resized to ``shape`` and their masks (``targets``: uint8 ``N×H×W``).

        The model runs once, on the first image: its class count is the number of score maps it returns.

        Raises:
            DataError: for a spec without masks, output that is not per-pixel class scores, masks
                without a scored pixel, or a mask class the model does not predict.
        """
        images, masks = data.segmentation_masks(spec, split, shape, samples)
        probe = list(output_batches(self, model, EvalSet(spec, images[:1], None), 1))[0]
        if probe.dim() != 4:
            raise DataError(f"the model's output {tuple(probe.shape)} is not per-pixel class scores N×K×H×W; "
                            "--eval segfolder scores segmentation models")
        classes = probe.shape[1]
        labels = masks[masks != IGNORE_INDEX]
        if not labels.numel():
            raise DataError(f"every pixel of the {split} masks of {spec} is {IGNORE_INDEX} (not scored); give masks "
                            "with class indices")
        if int(labels.max()) >= classes:
            raise DataError(f"the masks of {spec} hold class {int(labels.max())}, but the model predicts {classes} "
                            f"classes (0-{classes - 1}); give masks of its classes ({IGNORE_INDEX}: not scored)")
        return EvalSet(spec, images, masks, classes, kind=self.name, split=split, unit="images")

    def eval_outputs(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int) -> torch.Tensor:
        """Each pixel's predicted class (uint8 ``N×H×W``, int64 beyond 256 classes): the arg-max of the first output,
        its scores resized bilinearly to the masks' size when the model returns a smaller map.

        Batches shrink below ``batch_size`` so that at most :data:`SCORES_PER_BATCH` scores are held at once.
        """
        import torch

        size = tuple(eval_set.targets.shape[-2:])
        step = max(1, min(batch_size, SCORES_PER_BATCH // (eval_set.num_classes * size[0] * size[1])))
        return torch.cat([class_map(scores, size) for scores in output_batches(self, model, eval_set, step)])

    def score(self, outputs: torch.Tensor, eval_set: EvalSet, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """mIoU and pixel accuracy against the masks and, given the original's class maps, the share of pixels
        predicted as the original predicts them.

        Only the first ``len(outputs)`` images count (an ONNX file with a static batch size scores whole batches only).

        Returns:
            ``{"samples", "mean_iou", "accuracy", "agreement"}`` (``accuracy``: pixel accuracy;
            ``agreement``: ``None`` without a reference).
        """
        n = len(outputs)
        confusion = sum(confusion_matrix(outputs[i:i + IMAGES_PER_COUNT], eval_set.targets[i:i + IMAGES_PER_COUNT],
                                         eval_set.num_classes) for i in range(0, n, IMAGES_PER_COUNT))
        figures = iou_scores(confusion)
        agreement = int((outputs == reference[:n]).sum()) / outputs.numel() if reference is not None else None
        return {"samples": n, "mean_iou": figures["miou"], "accuracy": figures["pixel_accuracy"],
                "agreement": agreement}


def class_map(scores: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """The arg-max class of ``N×K×h×w`` scores at ``size`` (``H, W``; the scores are resized bilinearly to it)."""
    import torch
    import torch.nn.functional as F

    if tuple(scores.shape[-2:]) != tuple(size):
        scores = F.interpolate(scores, size=tuple(size), mode="bilinear", align_corners=False)
    return scores.argmax(1).to(torch.uint8 if scores.shape[1] <= 256 else torch.int64)


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
    return iou_scores(confusion_matrix(predicted, target, num_classes, ignore_index=ignore_index))


def confusion_matrix(predicted: torch.Tensor, target: torch.Tensor, num_classes: int, *,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Scored pixels by (target class, predicted class): a ``num_classes × num_classes`` int64 count.

    Counts of several batches add up to the count of all of them (see :func:`mean_iou` for the arguments).

    Raises:
        ValueError: for shapes that differ, or a label outside the class range.
    """
    import torch

    if predicted.shape != target.shape:
        raise ValueError(f"predicted and target masks differ in shape: {tuple(predicted.shape)} and "
                         f"{tuple(target.shape)}")
    scored = target != ignore_index
    truth, guess = target[scored].long(), predicted[scored].long()
    if truth.numel() and (int(truth.min()) < 0 or int(truth.max()) >= num_classes or int(guess.min()) < 0
                          or int(guess.max()) >= num_classes):
        raise ValueError(f"a mask holds a label outside 0..{num_classes - 1} (other than {ignore_index})")
    return torch.bincount(truth * num_classes + guess, minlength=num_classes ** 2).reshape(num_classes, num_classes)


def iou_scores(confusion: torch.Tensor) -> dict[str, float]:
    """``{"miou", "pixel_accuracy"}`` of a :func:`confusion_matrix` (see :func:`mean_iou`).

    Raises:
        ValueError: when it counts no pixel.
    """
    if int(confusion.sum()) == 0:
        raise ValueError("no pixel of the masks is scored: every one is the ignored label")
    hits = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - hits
    present = union > 0
    return {"miou": float((hits[present] / union[present]).mean()),
            "pixel_accuracy": float(hits.sum() / confusion.sum())}
