"""Segmentation and detection scores against figures worked out by hand (#28: each kind scores itself)."""

from __future__ import annotations

import pytest
import torch

from optkit.kinds.detection import mean_average_precision
from optkit.kinds.segmentation import IGNORE_INDEX, mean_iou


def test_mean_iou_of_a_hand_worked_case_skips_ignored_pixels_and_absent_classes():
    # target 0 0 1 2 (+ one ignored pixel), predicted 0 1 1 1 (+ anything):
    # class 0: 1 / (1 + 0 + 1); class 1: 1 / (1 + 2 + 0); class 2: 0 / 1; class 3 occurs nowhere.
    target = torch.tensor([[[0, 0, 1, 2, IGNORE_INDEX]]])
    predicted = torch.tensor([[[0, 1, 1, 1, 3]]])
    scores = mean_iou(predicted, target, num_classes=4)
    assert scores["miou"] == pytest.approx((1 / 2 + 1 / 3 + 0) / 3, abs=1e-12)
    assert scores["pixel_accuracy"] == pytest.approx(2 / 4, abs=1e-12)


def test_mean_iou_is_one_for_a_perfect_prediction_and_refuses_bad_masks():
    target = torch.randint(0, 5, (2, 8, 8), generator=torch.Generator().manual_seed(0))
    assert mean_iou(target.clone(), target, 5) == {"miou": 1.0, "pixel_accuracy": 1.0}
    with pytest.raises(ValueError, match="outside 0..4"):
        mean_iou(target, torch.full_like(target, 7), 5)
    with pytest.raises(ValueError, match="ignored"):
        mean_iou(target, torch.full_like(target, IGNORE_INDEX), 5)
    with pytest.raises(ValueError, match="shape"):
        mean_iou(target[:1], target, 5)


def boxes(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_mean_average_precision_of_a_hand_worked_case():
    # Class 1: two boxes; detections at 0.9 (exact), 0.8 (no overlap), 0.7 (IoU 0.62 with the second box).
    # Precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1: AP = 1/2 * 1 + 1/2 * 2/3 = 5/6 up to IoU 0.6,
    # and 1/2 from 0.65 on (the third detection misses). Class 2: its only detection lies on a class-1
    # box and must not match it: AP 0.
    targets = [{"boxes": boxes([20, 20, 30, 30], [0, 0, 10, 10], [50, 50, 60, 60]), "labels": torch.tensor([1, 1, 2])}]
    detections = [{"boxes": boxes([20, 20, 30, 30], [70, 70, 80, 80], [0, 0, 10, 6.2], [20, 20, 30, 30]),
                   "scores": torch.tensor([0.9, 0.8, 0.7, 0.95]), "labels": torch.tensor([1, 1, 1, 2])}]
    scores = mean_average_precision(detections, targets)
    assert scores["map50"] == pytest.approx((5 / 6 + 0) / 2, abs=1e-9)
    assert scores["map"] == pytest.approx(((3 * 5 / 6 + 7 * 1 / 2) / 10 + 0) / 2, abs=1e-9)


def test_mean_average_precision_counts_a_box_once_and_spans_images():
    # Two images, one box each; the duplicate detection on image 0 is a false positive ranked above
    # image 1's hit: precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1 -> AP 5/6 at every threshold.
    targets = [{"boxes": boxes([0, 0, 10, 10]), "labels": torch.tensor([3])},
               {"boxes": boxes([5, 5, 15, 15]), "labels": torch.tensor([3])}]
    detections = [{"boxes": boxes([0, 0, 10, 10], [0, 0, 10, 10]), "scores": torch.tensor([0.9, 0.8]),
                   "labels": torch.tensor([3, 3])},
                  {"boxes": boxes([5, 5, 15, 15]), "scores": torch.tensor([0.5]), "labels": torch.tensor([3])}]
    assert mean_average_precision(detections, targets) == pytest.approx({"map50": 5 / 6, "map": 5 / 6}, abs=1e-9)
    with pytest.raises(ValueError, match="no box"):
        mean_average_precision(detections, [{"boxes": boxes(), "labels": torch.tensor([])}] * 2)
