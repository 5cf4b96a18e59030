"""Tiny segmentation folders and COCO folders with known contents, for the segfolder/coco specs and their scoring."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import MultiScaleRoIAlign

from optkit.data.splits import name_split

#: Pixel values of the synthetic masks: left half, right half, and the unscored top row.
LEFT, RIGHT, VOID = 1, 2, 255


def names_in(split: str, count: int, suffix: str = ".png", prefix: str = "img") -> list[str]:
    """The first ``count`` file names ``img000.png``, ``img001.png``... that the hash rule puts in ``split``."""
    names, index = [], 0
    while len(names) < count:
        name = f"{prefix}{index:03d}{suffix}"
        if name_split(name) == split:
            names.append(name)
        index += 1
    return names


def split_counts(train: int = 2, val: int = 1, test: int = 3, suffix: str = ".png") -> dict[str, list[str]]:
    """File names for each split, by the hash rule."""
    return {split: names_in(split, count, suffix) for split, count in (("train", train), ("val", val), ("test", test))}


def half_mask(width: int, height: int) -> np.ndarray:
    """Class :data:`LEFT` in columns below ``width // 2``, :data:`RIGHT` in the others, the top row :data:`VOID`."""
    mask = np.full((height, width), RIGHT, dtype=np.uint8)
    mask[:, :width // 2] = LEFT
    mask[0] = VOID
    return mask


def write_segfolder(root: Path, names: list[str], size: tuple[int, int] = (16, 12), palette: bool = True) -> Path:
    """A segmentation folder: each image red on its left half and blue on its right, its mask :func:`half_mask`.

    ``size`` is ``(width, height)``; masks are palette PNGs (as VOC's are) unless ``palette`` is false.
    """
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    width, height = size
    for name in names:
        mask = half_mask(width, height)
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[mask == LEFT] = (200, 0, 0)
        pixels[mask != LEFT] = (0, 0, 200)
        Image.fromarray(pixels).save(root / "images" / name)
        image = Image.fromarray(mask, mode="L")
        if palette:
            image = image.convert("P")
        image.save(root / "masks" / f"{Path(name).stem}.png")
    return root


def write_coco(root: Path, images: dict[str, tuple[tuple[int, int], list[tuple[float, ...]]]], *,
               image_dir: str = "images", extra: dict | None = None) -> Path:
    """A COCO folder: ``{file_name: ((width, height), [(x, y, w, h, category), ...])}``.

    Image ``i`` (in the order given) is uniformly ``10 * (i + 1)`` in its red channel, so a stand-in
    detector can tell which image it is given after resizing.
    """
    folder = root / image_dir if image_dir else root
    folder.mkdir(parents=True, exist_ok=True)
    entries, annotations = [], []
    for index, (name, ((width, height), boxes)) in enumerate(images.items()):
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[..., 0] = 10 * (index + 1)
        Image.fromarray(pixels).save(folder / name)
        entries.append({"file_name": name, "id": 100 + index, "width": width, "height": height})
        annotations += [{"id": len(annotations) + 1, "image_id": 100 + index, "bbox": list(box[:4]),
                         "category_id": int(box[4]), "iscrowd": 0} for box in boxes]
    data = {"images": entries, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}],
            **(extra or {})}
    (root / "annotations.json").write_text(json.dumps(data), encoding="utf-8")
    return root


def image_index(image) -> int:
    """Which image of :func:`write_coco` a (resized, 0-1) image tensor is: its red value at the top left."""
    return round(float(image[0, 0, 0]) * 255 / 10) - 1


class TinyFasterRCNN(FasterRCNN):
    """A Faster R-CNN with a two-convolution backbone, at 64 pixels (``--arch dense_data:TinyFasterRCNN``).

    Its classifier favours class 1, so even untrained it finds boxes with scores above 0.5.
    """

    def __init__(self, num_classes: int = 3):
        backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        backbone.out_channels = 16
        super().__init__(backbone, num_classes=num_classes, rpn_anchor_generator=AnchorGenerator(((16,),), ((1.0,),)),
                         box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), min_size=64, max_size=64,
                         representation_size=64)
        with torch.no_grad():
            self.roi_heads.box_predictor.cls_score.bias[1] = 6.0
