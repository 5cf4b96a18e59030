"""Segmentation and detection models scored on data (--eval segfolder:DIR / coco:DIR): figures worked out by hand
for models whose predictions are known, the ONNX files, the CLI and its refusals."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from optkit.analysis.evaluation import DataReaders
from optkit.cli import main
from optkit.core.errors import DataError, OptkitError
from optkit.kinds import kind_of
from optkit.kinds.detection import Detection
from optkit.kinds.segmentation import Segmentation, class_map
from tests.support.dense_data import (LEFT, RIGHT, TinyFasterRCNN, image_index, split_counts, write_coco,
                                      write_segfolder)

WIDTH, HEIGHT = 16, 12
SEG_SHAPE = (1, 3, HEIGHT, WIDTH)


class ColumnModel(nn.Module):
    """Predicts class LEFT in the columns below ``boundary`` and RIGHT from it on, whatever the image.

    Its ``backbone`` is an ``IntermediateLayerGetter``, so it is a segmentation model to optkit.
    """

    def __init__(self, boundary: int, classes: int = 3):
        super().__init__()
        self.backbone = IntermediateLayerGetter(nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 1))), {"conv": "out"})
        self.boundary, self.classes = boundary, classes

    def forward(self, x):
        features = self.backbone(x)["out"]
        left = (torch.arange(x.shape[-1]) < self.boundary).float().expand(x.shape[0], 1, x.shape[-2], x.shape[-1])
        scores = torch.cat([torch.zeros_like(left)] * self.classes, dim=1)
        scores[:, LEFT:LEFT + 1] = left
        scores[:, RIGHT:RIGHT + 1] = 1 - left
        return {"out": scores + 0 * features.mean()}


@pytest.fixture
def segfolder(tmp_path) -> Path:
    """Three test images (and two train, one val) of 16×12: class LEFT in columns 0-7, RIGHT in 8-15, top row void."""
    return write_segfolder(tmp_path / "seg", sum(split_counts(train=2, val=1, test=3).values(), []),
                           size=(WIDTH, HEIGHT))


def seg_eval_set(model, folder: Path, samples: int = 10):
    return kind_of(model).eval_set(model, SEG_SHAPE, f"segfolder:{folder}", split="test", samples=samples,
                                   data=DataReaders(model))


def test_miou_pixel_accuracy_and_agreement_of_a_prediction_one_column_off(segfolder):
    exact, off = ColumnModel(boundary=8), ColumnModel(boundary=9)
    kind = kind_of(exact)
    assert isinstance(kind, Segmentation)
    eval_set = seg_eval_set(exact, segfolder)
    assert len(eval_set) == 3 and eval_set.num_classes == 3
    reference = kind.eval_outputs(exact, eval_set, 2)
    assert kind.score(reference, eval_set) == {"samples": 3, "mean_iou": 1.0, "accuracy": 1.0, "agreement": None}
    scores = kind.score(kind.eval_outputs(off, eval_set, 2), eval_set, reference)
    # Per scored row (11 of 12): LEFT has 8 hits and 1 false positive (column 8), RIGHT 7 hits and 1 miss.
    assert scores["mean_iou"] == pytest.approx((8 / 9 + 7 / 8) / 2, abs=1e-12)
    assert scores["accuracy"] == pytest.approx(15 / 16, abs=1e-12)
    # Agreement counts every pixel, the void row too: one column of 16 differs.
    assert scores["agreement"] == pytest.approx(15 / 16, abs=1e-12)
    assert torch.equal(kind.eval_outputs(off, eval_set, 1), kind.eval_outputs(off, eval_set, 3))


def test_scores_smaller_than_the_masks_are_resized_before_the_arg_max():
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 1, 0, 0] = scores[0, 2, 0, 1] = scores[0, 0, 1, :] = 1.0
    predicted = class_map(scores, (4, 4))
    assert predicted.dtype == torch.uint8
    assert predicted[0, 0].tolist() == [1, 1, 2, 2] and predicted[0, 3].tolist() == [0, 0, 0, 0]


def test_the_exported_segmentation_file_scores_as_the_model(segfolder, tmp_path):
    from optkit.export.onnx import export_onnx

    model = ColumnModel(boundary=9)
    kind = kind_of(model)
    eval_set = seg_eval_set(model, segfolder)
    path = tmp_path / "model.onnx"
    export_onnx(model, path, SEG_SHAPE)
    reference = kind.eval_outputs(ColumnModel(boundary=8), eval_set, 2)
    from_file = kind.eval_outputs(str(path), eval_set, 2)
    assert torch.equal(from_file, kind.eval_outputs(model, eval_set, 2))
    assert kind.score(from_file, eval_set, reference)["mean_iou"] == pytest.approx((8 / 9 + 7 / 8) / 2, abs=1e-12)


def test_data_a_segmentation_model_cannot_be_scored_on_is_refused(segfolder, tmp_path):
    def refused(call, fragment):
        with pytest.raises(DataError) as caught:
            call()
        assert "\n" not in str(caught.value) and fragment in str(caught.value), str(caught.value)

    refused(lambda: seg_eval_set(ColumnModel(8, classes=2), segfolder),
            "hold class 2, but the model predicts 2 classes")
    model = ColumnModel(8)
    for spec in ("synthetic:8:3x12x16:3", f"coco:{tmp_path}"):
        refused(lambda: kind_of(model).eval_set(model, SEG_SHAPE, spec, split="test", samples=4,
                                                data=DataReaders(model)), "give --eval segfolder:DIR")
    void = write_segfolder(tmp_path / "void", [p.name for p in (segfolder / "images").iterdir()])
    for mask in (void / "masks").iterdir():
        Image.new("L", (WIDTH, HEIGHT), 255).save(mask)
    refused(lambda: seg_eval_set(model, void), "is 255 (not scored)")


# --- detection --------------------------------------------------------------------------------------------------

class FixedDetector(nn.Module):
    """Returns given detections for each image of :func:`write_coco`, told apart by its colour.

    Its detection transform makes it a detector to optkit.

    Args:
        detections: per image index, ``(x1, y1, x2, y2, score, label)`` rows.
    """

    def __init__(self, detections: dict[int, list[tuple[float, ...]]]):
        super().__init__()
        self.transform = GeneralizedRCNNTransform(32, 32, [0.0] * 3, [1.0] * 3)
        self.backbone = nn.Conv2d(3, 1, 1)
        self.detections = detections

    def forward(self, images):
        found = []
        for image in images:
            rows = torch.tensor(self.detections.get(image_index(image), []), dtype=torch.float32).reshape(-1, 6)
            found.append({"boxes": rows[:, :4], "scores": rows[:, 4], "labels": rows[:, 5].long()})
        return found


DET_SHAPE = (1, 3, 32, 32)
#: The tiny detector as a user's own class (tests/support is on the path, as a user's package would be).
TINY_DETECTOR = "dense_data:TinyFasterRCNN"


@pytest.fixture
def coco_folder(tmp_path) -> Path:
    """Two 32×32 test images (indices 2 and 3): one box on the first, two on the second."""
    splits = split_counts(train=1, val=1, test=2)
    first, second = splits["test"]
    return write_coco(tmp_path / "coco", {
        splits["train"][0]: ((32, 32), [(0, 0, 8, 8, 1)]),
        splits["val"][0]: ((32, 32), [(0, 0, 8, 8, 1)]),
        first: ((32, 32), [(0, 0, 10, 10, 1)]),
        second: ((32, 32), [(5, 5, 10, 10, 1), (16, 16, 12, 12, 1)]),
    })


#: The true boxes (scores 0.95, 0.9, 0.8) and a faint false one (0.3) that is no agreement target.
EXACT = {2: [(0, 0, 10, 10, 0.95, 1), (40, 40, 50, 50, 0.3, 1)],
         3: [(5, 5, 15, 15, 0.9, 1), (16, 16, 28, 28, 0.8, 1)]}
#: One hit (0.9), one false positive (0.8), one box overlapping IoU 0.77 (0.7), one box missed.
NEAR_MISS = {2: [(0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.8, 1)], 3: [(5, 5, 15, 12.7, 0.7, 1)]}


def det_eval_set(model, folder: Path):
    return kind_of(model).eval_set(model, DET_SHAPE, f"coco:{folder}", split="test", samples=10,
                                   data=DataReaders(model))


def test_map_and_agreement_with_one_false_positive_and_one_missed_box(coco_folder):
    exact, near = FixedDetector(EXACT), FixedDetector(NEAR_MISS)
    kind = kind_of(near)
    assert isinstance(kind, Detection)
    eval_set = det_eval_set(exact, coco_folder)
    assert len(eval_set) == 2 and eval_set.num_classes is None
    reference = kind.eval_outputs(exact, eval_set, 4)
    assert kind.score(reference, eval_set) == {"samples": 2, "map50": 1.0, "map": 1.0, "agreement": None,
                                               "accuracy": None}
    assert kind.score(reference, eval_set, reference)["agreement"] == 1.0
    scores = kind.score(kind.eval_outputs(near, eval_set, 1), eval_set, reference)
    # Ranked 0.9 hit, 0.8 false, 0.7 hit while IoU 0.77 passes the threshold: precision 1, 1/2, 2/3 at recall
    # 1/3, 1/3, 2/3, AP 5/9 (thresholds 0.50-0.75); from 0.80 the 0.7 box misses too, AP 1/3.
    assert scores["map50"] == pytest.approx(5 / 9, abs=1e-9)
    assert scores["map"] == pytest.approx((6 * 5 / 9 + 4 * 1 / 3) / 10, abs=1e-9)
    # Against the original's confident boxes (the three true ones; not its 0.3 box, which would make it 5/12).
    assert scores["agreement"] == pytest.approx(5 / 9, abs=1e-9)


def test_agreement_is_none_when_the_original_finds_nothing_confident(coco_folder):
    faint = FixedDetector({2: [(0, 0, 10, 10, 0.4, 1)]})
    kind = kind_of(faint)
    eval_set = det_eval_set(faint, coco_folder)
    reference = kind.eval_outputs(faint, eval_set, 2)
    scores = kind.score(kind.eval_outputs(FixedDetector(NEAR_MISS), eval_set, 2), eval_set, reference)
    assert scores["agreement"] is None and scores["map50"] == pytest.approx(5 / 9, abs=1e-9)


def test_a_category_the_detector_has_no_class_for_is_refused(tmp_path):
    names = sum(split_counts(train=1, val=1, test=1).values(), [])
    folder = write_coco(tmp_path / "coco", {name: ((32, 32), [(1, 1, 8, 8, 3)]) for name in names})
    model = TinyFasterRCNN(num_classes=3).eval()
    with pytest.raises(DataError, match=r"category_id 3, but the model has 3 classes \(0 is the background\)"):
        det_eval_set(model, folder)
    with pytest.raises(DataError, match="give --eval coco:DIR"):
        kind_of(model).eval_set(model, DET_SHAPE, f"segfolder:{tmp_path}", split="test", samples=2,
                                data=DataReaders(model))


def test_an_onnx_file_without_boxes_scores_and_labels_is_refused_in_one_line(coco_folder, tmp_path):
    class Sum(nn.Module):
        def forward(self, image):
            return image.sum(0)

    path = tmp_path / "other.onnx"
    torch.onnx.export(Sum(), (torch.rand(3, 32, 32),), str(path), input_names=["images"], output_names=["total"],
                      dynamo=False)
    model = FixedDetector(EXACT)
    with pytest.raises(OptkitError) as caught:
        kind_of(model).eval_outputs(str(path), det_eval_set(model, coco_folder), 1)
    assert "\n" not in str(caught.value) and "does not return boxes, scores and labels" in str(caught.value)


# --- the CLI ----------------------------------------------------------------------------------------------------

def evaluation(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())["evaluation"]


def assert_scored(section: dict, keys: list[str], stages: list[str]) -> None:
    assert [c["key"] for c in section["columns"]] == keys
    rows = {row["stage"]: row for row in section["stages"]}
    assert list(rows) == stages
    for stage, row in rows.items():
        for key in keys:
            if stage == "original" and key == "agreement":
                assert row[key] is None
            else:
                assert 0.0 <= row[key] <= 1.0, (stage, key, row[key])


def test_optimize_scores_a_segmentation_model_on_a_segmentation_folder(runner, tmp_path):
    folder = write_segfolder(tmp_path / "seg", sum(split_counts(train=2, val=1, test=3).values(), []), size=(80, 60))
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", "torchvision:lraspp_mobilenet_v3_large", "--prune", "0.3",
                                  "--input-shape", "1,3,64,64", "--no-latency", "--eval", f"segfolder:{folder}",
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    section = evaluation(out)
    assert section["samples"] == 3 and section["data"] == f"segfolder:{folder}"
    assert_scored(section, ["mean_iou", "accuracy", "agreement"], ["original", "after structured_prune"])
    assert "| stage | mIoU | pixel accuracy | agreement with original |" in (out / "report.md").read_text()


def test_optimize_scores_a_detector_and_its_onnx_file_on_a_coco_folder(runner, tmp_path):
    splits = split_counts(train=1, val=1, test=3)
    folder = write_coco(tmp_path / "coco", {name: ((64, 48), [(4, 4, 20, 16, 1), (30, 20, 16, 20, 2)])
                                            for name in sum(splits.values(), [])})
    model_file = tmp_path / "detector.pt"
    torch.save(TinyFasterRCNN().state_dict(), model_file)
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", str(model_file), "--arch", TINY_DETECTOR, "--prune", "0.3",
                                  "--input-shape", "1,3,64,64", "--export", "onnx", "--no-latency", "--eval", f"coco:{folder}",
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert_scored(evaluation(out), ["map50", "map", "agreement"],
                  ["original", "after structured_prune", "model.onnx (ONNX Runtime)"])
    assert "| stage | mAP@0.5 | mAP@0.5:0.95 | agreement with original (mAP@0.5) |" in (out / "report.md").read_text()


@pytest.mark.slow
def test_optimize_scores_torchvisions_faster_rcnn_and_its_onnx_file(runner, tmp_path):
    splits = split_counts(train=1, val=1, test=2)
    folder = write_coco(tmp_path / "coco", {name: ((80, 60), [(4, 4, 30, 20, 1), (40, 20, 30, 30, 4)])
                                            for name in sum(splits.values(), [])})
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", "--num-classes",
                                  "5", "--prune", "0.3", "--input-shape", "1,3,64,64", "--export", "onnx",
                                  "--no-latency", "--eval", f"coco:{folder}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    section = evaluation(out)
    assert [row["stage"] for row in section["stages"]] == ["original", "after structured_prune",
                                                            "model.onnx (ONNX Runtime)"]
    for row in section["stages"]:
        assert 0.0 <= row["map50"] <= 1.0 and 0.0 <= row["map"] <= 1.0
        assert row["agreement"] is None or 0.0 <= row["agreement"] <= 1.0


def _refused(runner, args: list[str], out: Path, fragment: str) -> None:
    result = runner.invoke(main, [*args, "--no-latency", "--out", str(out)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote files"


def test_eval_data_of_another_kind_or_broken_is_refused_in_one_line(runner, tmp_path):
    names = sum(split_counts(train=1, val=1, test=1).values(), [])
    seg = write_segfolder(tmp_path / "seg", names)
    coco = write_coco(tmp_path / "coco", {name: ((32, 32), [(1, 1, 8, 8, 1)]) for name in names})
    segmenter = ["optimize", "torchvision:lraspp_mobilenet_v3_large", "--prune", "0.3", "--input-shape", "1,3,32,32",
                 "--eval"]
    _refused(runner, [*segmenter, "synthetic:8:3x32x32:10"], tmp_path / "o1", "give --eval segfolder:DIR")
    _refused(runner, [*segmenter, f"coco:{coco}"], tmp_path / "o2", "give --eval segfolder:DIR")
    _refused(runner, ["optimize", "torchvision:resnet18", "--input-shape", "1,3,32,32", "--prune", "0.3", "--eval",
                      f"segfolder:{seg}"], tmp_path / "o3", "not labelled images")
    detector = tmp_path / "detector.pt"
    torch.save(TinyFasterRCNN().state_dict(), detector)
    det = ["optimize", str(detector), "--arch", TINY_DETECTOR, "--prune", "0.3", "--input-shape", "1,3,64,64", "--eval"]
    _refused(runner, [*det, f"segfolder:{seg}"], tmp_path / "o4", "give --eval coco:DIR")
    (seg / "masks" / f"{Path(names[0]).stem}.png").unlink()
    _refused(runner, [*segmenter, f"segfolder:{seg}"], tmp_path / "o5", "has no mask")
    (coco / "annotations.json").write_text('{"images": []}', encoding="utf-8")
    _refused(runner, [*det, f"coco:{coco}"], tmp_path / "o6", '"images" and "annotations" lists')
