"""Object detection: a list of images ``C,H,W`` in, a list of ``{"boxes", "scores", "labels"}`` dicts out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError
from optkit.kinds.base import ModelInputs, ModelKind, export_view, model_device
from optkit.kinds.image import input_channels

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Fields compared and exported per image, in this order; masks and keypoints follow when the model has them.
DETECTION_FIELDS = ("boxes", "scores", "labels")
EXTRA_FIELDS = ("masks", "keypoints", "keypoints_scores")
DEFAULT_IMAGE_SIZE = 320
#: Detections further apart than this (pixels, or score) are not the same detection (see _matched_difference).
MATCH_DISTANCE = 1.0
#: The share of detections that may differ between two runtimes at NMS and cut-off boundaries.
UNMATCHED_FRACTION = 0.05
BACKBONE = "backbone"


def has_detection_transform(model: nn.Module) -> bool:
    """Whether the model resizes and normalizes a list of images itself (torchvision's detection transform)."""
    try:
        from torchvision.models.detection.transform import GeneralizedRCNNTransform
    except ImportError:
        return False
    return any(isinstance(m, GeneralizedRCNNTransform) for m in model.children())


class Detection(ModelKind):
    """Detectors such as torchvision's Faster R-CNN, RetinaNet, FCOS and SSD.

    Recognised by structure: the model owns a detection transform (it takes a
    list of un-normalized images of any size). An input shape ``N,C,H,W`` means
    ``N`` images of ``C,H,W`` with values in [0, 1]. The exported graph takes
    the images as separate inputs (its image count is fixed) and returns each
    image's boxes, scores and labels. Two models' detections are compared as
    sets: each detection is matched with the other model's nearest one of the
    same label, and a few may differ where suppression decides between
    near-equal boxes. Structured pruning works inside the backbone; the feature maps
    it hands to the heads keep their width.
    """

    name = "detection"
    description = "detectors: a list of images C,H,W in, boxes, scores and labels per image out"
    priority = 10
    dynamic_batch = False

    def matches(self, model: nn.Module) -> bool:
        return has_detection_transform(model)

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        return (1, input_channels(model) or 3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)

    def check_shape(self, model: nn.Module, shape: tuple[int, ...]) -> None:
        if len(shape) != 4:
            raise OptkitError(f"a detection model takes images; give --input-shape N,C,H,W (N images), "
                              f"not {','.join(map(str, shape))}")

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        import torch

        self.check_shape(model, shape)
        generator = torch.Generator().manual_seed(seed)
        device = model_device(model)
        images = [torch.rand(*shape[1:], generator=generator).to(device) for _ in range(shape[0])]
        names = ("images",) if len(images) == 1 else tuple(f"image_{i}" for i in range(len(images)))
        return ModelInputs((images,), {}, names)

    def outputs(self, output: Any) -> list[torch.Tensor]:
        if not isinstance(output, (list, tuple)) or not all(isinstance(d, dict) for d in output):
            return super().outputs(output)
        return [d[key] for d in output for key in (*DETECTION_FIELDS, *EXTRA_FIELDS) if key in d]

    def output_names(self, count: int) -> list[str]:
        if count % len(DETECTION_FIELDS):
            return super().output_names(count)
        images = count // len(DETECTION_FIELDS)
        return [f"{key}_{i}" if images > 1 else key for i in range(images) for key in DETECTION_FIELDS]

    def export_module(self, model: nn.Module, inputs: ModelInputs) -> nn.Module:
        return export_view(model, inputs, self)

    def compare(self, expected: list[Any], actual: list[Any]) -> tuple[float, float]:
        import numpy as np

        if len(actual) != len(expected) or len(expected) % len(DETECTION_FIELDS):
            return super().compare(expected, actual)
        diff = scale = 0.0
        for start in range(0, len(expected), len(DETECTION_FIELDS)):
            boxes, scores, labels = expected[start:start + 3]
            other_boxes, other_scores, other_labels = actual[start:start + 3]
            diff = max(diff, _matched_difference(np.column_stack([boxes, scores]), labels,
                                                 np.column_stack([other_boxes, other_scores]), other_labels))
            scale = max(scale, float(np.max(np.abs(boxes))) if boxes.size else 0.0)
        return diff, scale

    def prune_root(self, model: nn.Module) -> str | None:
        return BACKBONE if hasattr(model, BACKBONE) else None


def _matched_difference(reference, labels, other, other_labels) -> float:
    """Largest box/score difference between matched detections of two models on one image.

    Detections are matched from the highest score down, each with the other
    model's nearest unused detection of its label (within :data:`MATCH_DISTANCE`
    pixels or score). Non-maximum suppression and the per-image limit are
    discontinuous: a difference in the last digits can keep one of two
    near-equal boxes instead of the other, and with untrained weights many boxes
    are near-equal. So up to :data:`UNMATCHED_FRACTION` of the detections (at
    least one) may go unmatched on either side.

    Raises:
        ValueError: when more detections than that have no counterpart.
    """
    import numpy as np

    free = np.ones(len(other), dtype=bool)
    worst = 0.0
    unmatched = 0
    for index in np.argsort(-reference[:, 4], kind="stable"):
        candidates = np.flatnonzero(free & (other_labels == labels[index]))
        if not len(candidates):
            unmatched += 1
            continue
        distances = np.max(np.abs(other[candidates].astype(np.float64) - reference[index]), axis=1)
        if distances.min() > MATCH_DISTANCE:
            unmatched += 1
            continue
        free[candidates[int(np.argmin(distances))]] = False
        worst = max(worst, float(distances.min()))
    unmatched = max(unmatched, int(free.sum()))
    allowed = max(1, int(UNMATCHED_FRACTION * max(len(reference), len(other))))
    if unmatched > allowed:
        raise ValueError(f"{unmatched} of {max(len(reference), len(other))} detections have no counterpart "
                         f"(at most {allowed} may differ at suppression and cut-off boundaries)")
    return worst


#: IoU thresholds of the COCO-style average (0.50, 0.55, ..., 0.95).
COCO_IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))


def mean_average_precision(detections: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]],
                           ) -> dict[str, float]:
    """Detection quality of per-image detections against ground-truth boxes.

    Per class and IoU threshold, detections of all images are taken from the
    highest score down; each is a true positive when it overlaps a not yet
    matched ground-truth box of its class by at least the threshold. The
    average precision is the area under the precision-recall curve with
    precision made non-increasing (all-point interpolation); the mean is over
    the classes that have ground-truth boxes.

    Args:
        detections: per image, ``{"boxes": M×4 (x1, y1, x2, y2), "scores": M, "labels": M}``.
        targets: per image, ``{"boxes": G×4, "labels": G}``.

    Returns:
        ``{"map50", "map"}``: the mean AP at IoU 0.5, and averaged over IoU 0.50:0.95.

    Raises:
        ValueError: for lists of different lengths, or targets without any box.
    """
    if len(detections) != len(targets):
        raise ValueError(f"{len(detections)} images of detections for {len(targets)} images of targets")
    classes = sorted({int(label) for target in targets for label in target["labels"]})
    if not classes:
        raise ValueError("the targets hold no box: there is nothing to score")
    per_threshold = [sum(_average_precision(detections, targets, label, threshold) for label in classes)
                     / len(classes) for threshold in COCO_IOU_THRESHOLDS]
    return {"map50": per_threshold[0], "map": sum(per_threshold) / len(per_threshold)}


def _average_precision(detections, targets, label: int, threshold: float) -> float:
    import torch
    from torchvision.ops import box_iou

    found = []
    truths = 0
    for image, (detected, target) in enumerate(zip(detections, targets)):
        truths += int((target["labels"] == label).sum())
        keep = detected["labels"] == label
        found += [(float(score), image, box) for score, box in zip(detected["scores"][keep], detected["boxes"][keep])]
    if not found:
        return 0.0
    found.sort(key=lambda item: -item[0])
    used = [torch.zeros(int((t["labels"] == label).sum()), dtype=torch.bool) for t in targets]
    hits = []
    for _, image, box in found:
        truth = targets[image]["boxes"][targets[image]["labels"] == label]
        if len(truth) == 0:
            hits.append(False)
            continue
        overlaps = box_iou(box[None].float(), truth.float())[0].masked_fill(used[image], -1.0)
        best = int(overlaps.argmax())
        hit = float(overlaps[best]) >= threshold
        if hit:
            used[image][best] = True
        hits.append(hit)
    true_positives = torch.tensor(hits, dtype=torch.float64).cumsum(0)
    precision = true_positives / torch.arange(1, len(hits) + 1, dtype=torch.float64)
    recall = true_positives / truths
    envelope = precision.flip(0).cummax(0).values.flip(0)
    steps = torch.diff(torch.cat([torch.zeros(1, dtype=torch.float64), recall]))
    return float((steps * envelope).sum())
