"""Object detection: a list of images ``C,H,W`` in, a list of ``{"boxes", "scores", "labels"}`` dicts out."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError, OptkitError
from optkit.kinds.base import (EvalData, EvalSet, ModelInputs, ModelKind, ScoreColumn, export_view,
                               model_device)
from optkit.kinds.image import input_channels
from optkit.kinds.registry import register_kind

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
#: Two different detections of one label whose scores are this close are a near-tie that suppression or the
#: per-image limit may resolve either way; up to TIED_FRACTION of the detections may differ so, beyond the above.
SCORE_TIE = 1e-3
TIED_FRACTION = 0.25
BACKBONE = "backbone"
#: Images per forward pass at most while scoring: detectors resize images internally, often to 800 pixels.
IMAGES_PER_BATCH = 8
#: The original model's detections from this score up are the boxes the agreement with it is scored on.
AGREEMENT_SCORE = 0.5


def has_detection_transform(model: nn.Module) -> bool:
    """Whether the model resizes and normalizes a list of images itself (torchvision's detection transform)."""
    try:
        from torchvision.models.detection.transform import GeneralizedRCNNTransform
    except ImportError:
        return False
    return any(isinstance(m, GeneralizedRCNNTransform) for m in model.children())


@register_kind
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

    Scored on a COCO folder (``--eval coco:DIR``, see :mod:`optkit.data.coco`):
    mAP at IoU 0.5 and averaged over IoU 0.50:0.95
    (:func:`mean_average_precision`). The agreement with the original is the
    mAP at IoU 0.5 of this model's detections against the original's detections
    scoring :data:`AGREEMENT_SCORE` or more, taken as the true boxes (1 when it
    finds what the original found, and nothing of its own ranked above it;
    ``None`` when the original finds nothing that confident, as untrained
    weights do). A detector has no accuracy: ``accuracy`` is ``None``.
    """

    name = "detection"
    description = "detectors: a list of images C,H,W in, boxes, scores and labels per image out"
    priority = 10
    dynamic_batch = False
    throughput_unit = "images"
    score_columns = (ScoreColumn("map50", "mAP@0.5", ".2%"),
                     ScoreColumn("map", "mAP@0.5:0.95", ".2%"),
                     ScoreColumn("agreement", "agreement with original (mAP@0.5)", ".2%"))

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

    def eval_set(self, model: nn.Module, shape: tuple[int, ...], spec: str, *, split: str, samples: int,
                 data: EvalData) -> EvalSet:
        """Images of a COCO folder fitted into ``shape`` (``inputs``: ``N×C×H×W``) and their boxes (``targets``:
        ``{"boxes", "labels"}`` per image); ``num_classes`` is the model's, when its head says (see
        :func:`detector_classes`).

        Raises:
            DataError: for a spec without boxes, images that hold no box, or a category the model has no class for.
        """
        self.check_shape(model, shape)
        images, targets = data.detection_images(spec, split, shape, samples)
        top = max((int(t["labels"].max()) for t in targets if len(t["labels"])), default=None)
        if top is None:
            raise DataError(f"the first {len(targets)} {split} images of {spec} hold no box; give annotated images")
        classes = detector_classes(model)
        if classes is not None and top >= classes:
            raise DataError(f"{spec} has category_id {top}, but the model has {classes} classes (0 is the background); "
                            "give categories the model detects, or a model with more classes (--num-classes)")
        return EvalSet(spec, images, targets, classes, kind=self.name, split=split, unit="images")

    def eval_outputs(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet,
                     batch_size: int) -> list[dict[str, torch.Tensor]]:
        """Each image's ``{"boxes", "scores", "labels"}`` on the CPU: from a PyTorch model, at most
        :data:`IMAGES_PER_BATCH` images per call, or from an ONNX file optkit exported, as many images per call
        as it takes (whole calls only: a last, smaller group is left out).

        Raises:
            OptkitError: for an ONNX file that does not return boxes, scores and labels per image, or
                takes images of another size.
        """
        import torch

        if isinstance(model, (str, os.PathLike)):
            return _onnx_detections(model, eval_set)
        device = model_device(model)
        was_training = model.training
        model.eval()
        found = []
        try:
            for _, batch in eval_set.batches(max(1, min(batch_size, IMAGES_PER_BATCH))):
                with torch.no_grad():
                    output = model([image.to(device) for image in batch.first()])
                found += [_detections(d["boxes"], d["scores"], d["labels"]) for d in output]
        finally:
            model.train(was_training)
        return found

    def score(self, outputs: list[dict[str, torch.Tensor]], eval_set: EvalSet,
              reference: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        """mAP against the true boxes and, given the original's detections, the agreement with them (see the class).

        Only the first ``len(outputs)`` images count (an ONNX file scores whole calls only).

        Returns:
            ``{"samples", "map50", "map", "agreement", "accuracy"}`` (``agreement``: ``None`` without a
            reference or confident original detections; ``accuracy``: always ``None``).
        """
        n = len(outputs)
        targets = eval_set.targets[:n]
        figures = (mean_average_precision(outputs, targets) if any(len(t["labels"]) for t in targets)
                   else {"map50": None, "map": None})
        result = {"samples": n, **figures, "agreement": None, "accuracy": None}
        if reference is not None:
            confident = [{"boxes": r["boxes"][r["scores"] >= AGREEMENT_SCORE],
                          "labels": r["labels"][r["scores"] >= AGREEMENT_SCORE]} for r in reference[:n]]
            if any(len(c["labels"]) for c in confident):
                result["agreement"] = mean_average_precision(outputs, confident)["map50"]
        return result


def detector_classes(model: nn.Module) -> int | None:
    """The classes a detector tells apart, background (0) included, read from its head; ``None`` when unknown.

    Faster R-CNN's box predictor, RetinaNet's and FCOS's ``num_classes``, SSD's ``num_columns``.
    """
    cls_score = getattr(getattr(getattr(model, "roi_heads", None), "box_predictor", None), "cls_score", None)
    if isinstance(getattr(cls_score, "out_features", None), int):
        return cls_score.out_features
    head = getattr(getattr(model, "head", None), "classification_head", None)
    for attribute in ("num_classes", "num_columns"):
        if isinstance(getattr(head, attribute, None), int):
            return getattr(head, attribute)
    return None


def _detections(boxes, scores, labels) -> dict[str, torch.Tensor]:
    return {"boxes": boxes.detach().float().cpu(), "scores": scores.detach().float().cpu(),
            "labels": labels.detach().long().cpu()}


def _onnx_detections(path: str | os.PathLike, eval_set: EvalSet) -> list[dict[str, torch.Tensor]]:
    """Detections of an exported detector: one input per image, and per image its boxes, scores and labels first
    among its outputs (a Mask R-CNN's masks follow; see :meth:`Detection.outputs`)."""
    import torch

    from optkit.runtime.onnxrt import onnx_session

    session = onnx_session(path)
    inputs, outputs = session.get_inputs(), session.get_outputs()
    count, fields = len(inputs), len(DETECTION_FIELDS)
    per_image = len(outputs) // count
    refusal = (f"{os.fspath(path)} does not return boxes, scores and labels for each of its {count} image input(s); "
               "optkit scores the detection files it exports")
    if len(outputs) % count or per_image < fields:
        raise OptkitError(refusal)
    images = eval_set.inputs
    declared = inputs[0].shape
    if any(isinstance(d, int) and d != size for d, size in zip(declared, images.shape[1:])):
        raise OptkitError(f"{os.fspath(path)} takes images of {'×'.join(map(str, declared))}, but the scoring images "
                          f"are {'×'.join(map(str, images.shape[1:]))}; export at the input shape that was scored")
    found = []
    for start in range(0, len(images) - count + 1, count):
        values = session.run(None, {value.name: images[start + i].numpy() for i, value in enumerate(inputs)})
        for i in range(count):
            boxes, scores, labels = values[i * per_image:i * per_image + fields]
            if boxes.ndim != 2 or boxes.shape[1] != 4 or not scores.shape == labels.shape == (len(boxes),):
                raise OptkitError(refusal)
            found.append(_detections(*(torch.from_numpy(v) for v in (boxes, scores, labels))))
    return found


def _matched_difference(reference, labels, other, other_labels) -> float:
    """Largest box/score difference between matched detections of two models on one image.

    Detections are matched from the highest score down, each with the other
    model's nearest unused detection of its label (within :data:`MATCH_DISTANCE`
    pixels or score). Non-maximum suppression and the per-image limit are
    discontinuous: a difference in the last digits can keep one of two
    near-equal boxes instead of the other, and with untrained weights many boxes
    are near-equal. So up to :data:`UNMATCHED_FRACTION` of the detections (at
    least one) may go unmatched on either side, and beyond that up to
    :data:`TIED_FRACTION` whose place the other model gives to an overlapping
    box of the same label scored within :data:`SCORE_TIE` (a near-tie resolved
    the other way). Boxes that are wrong everywhere still fail.

    Raises:
        ValueError: when more detections than that have no counterpart.
    """
    import numpy as np

    free = np.ones(len(other), dtype=bool)
    worst = 0.0
    missing = []
    for index in np.argsort(-reference[:, 4], kind="stable"):
        candidates = np.flatnonzero(free & (other_labels == labels[index]))
        if not len(candidates):
            missing.append(index)
            continue
        distances = np.max(np.abs(other[candidates].astype(np.float64) - reference[index]), axis=1)
        if distances.min() > MATCH_DISTANCE:
            missing.append(index)
            continue
        free[candidates[int(np.argmin(distances))]] = False
        worst = max(worst, float(distances.min()))
    ties = _near_ties(reference[missing], labels[missing], other[free], other_labels[free])
    total = max(len(reference), len(other))
    unmatched = max(len(missing), int(free.sum())) - min(ties, int(TIED_FRACTION * total))
    allowed = max(1, int(UNMATCHED_FRACTION * total))
    if unmatched > allowed:
        raise ValueError(f"{unmatched} of {total} detections have no counterpart, near-ties apart "
                         f"(at most {allowed} may differ at suppression and cut-off boundaries)")
    return worst


def _near_ties(reference, labels, other, other_labels) -> int:
    """How many unmatched detections (rows ``x1, y1, x2, y2, score``) pair with an unmatched one of the other side
    that has their label, overlaps their box and scores within :data:`SCORE_TIE`: two near-equal boxes of which
    suppression kept one here and the other there."""
    import numpy as np

    free = np.ones(len(other), dtype=bool)
    ties = 0
    for index in np.argsort(-reference[:, 4], kind="stable"):
        box = reference[index]
        candidates = np.flatnonzero(free & (other_labels == labels[index])
                                    & (np.abs(other[:, 4] - box[4]) <= SCORE_TIE))
        overlaps = [_intersection(box, other[c]) for c in candidates]
        if overlaps and max(overlaps) > 0:
            free[candidates[int(np.argmax(overlaps))]] = False
            ties += 1
    return ties


def _intersection(a, b) -> float:
    """The area two ``x1, y1, x2, y2`` boxes share."""
    return max(0.0, float(min(a[2], b[2]) - max(a[0], b[0]))) * max(0.0, float(min(a[3], b[3]) - max(a[1], b[1])))


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
