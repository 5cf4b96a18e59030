"""COCO detection folders (``coco:DIR``): images and their boxes, to score detection models (``--eval``).

Layout::

    DIR/annotations.json   COCO format: "images" (file_name, id, width, height) and
                           "annotations" (image_id, bbox [x, y, width, height], category_id)
    DIR/images/FILE_NAME   each image's file_name (or DIR/FILE_NAME, beside the json)

Category ids are the model's labels, as torchvision's detectors number them
(1 and up; 0 is the background), so a COCO-trained torchvision model reads
COCO's own ids. Crowd annotations (``"iscrowd": 1``) and boxes without area
(a width or height of 0) are left out, as torchvision's references do. Images
without annotations stay: every detection on them is a false positive.

Images are split into ``train``, ``val`` and ``test`` by their file name (see
:func:`optkit.data.splits.split_names`). Each is fitted into the model's input
size: scaled by one factor, so that it keeps its aspect ratio, to fit ``H×W``,
and padded with zeros on the right and bottom; its boxes are scaled by the same
factor. Every stage then takes images of the same size, the size an exported
detector's graph was traced at. Values stay in [0, 1]: torchvision's detectors
normalize their images themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError
from optkit.data.segfolder import open_image
from optkit.data.specs import parse_spec
from optkit.data.splits import split_names

if TYPE_CHECKING:
    import torch

__all__ = ["ANNOTATIONS", "CocoImage", "coco_images", "read_coco"]

ANNOTATIONS = "annotations.json"
LAYOUT_HINT = f"give coco:DIR with DIR/{ANNOTATIONS} (COCO format) and the images under DIR/images/"


@dataclass(frozen=True)
class CocoImage:
    """One image of a COCO file and its boxes.

    Attributes:
        path: the image file.
        file_name: its name in the COCO file (what the split is decided by).
        width: its width in pixels, as the COCO file gives it.
        height: its height in pixels.
        boxes: ``(x1, y1, x2, y2)`` per box, in pixels.
        labels: the category id of each box.
    """

    path: Path
    file_name: str
    width: int
    height: int
    boxes: tuple[tuple[float, float, float, float], ...]
    labels: tuple[int, ...]


def coco_images(arg: str) -> list[CocoImage]:
    """The images of a COCO folder with their boxes, sorted by file name, without reading pixels.

    Args:
        arg: what follows ``coco:`` (the folder).

    Raises:
        DataError: for a missing folder or annotations file, a file that is not COCO (no
            ``images`` and ``annotations`` lists, an entry without its fields, a box of negative
            size, a category below 1, an annotation of no image), or a missing image file.
    """
    root = Path(arg)
    if not root.is_dir():
        raise DataError(f"COCO folder {arg} not found; {LAYOUT_HINT}")
    path = root / ANNOTATIONS
    data = _read_json(path)
    if not isinstance(data, dict) or not all(isinstance(data.get(key), list) for key in ("images", "annotations")):
        raise DataError(f'{path} has no "images" and "annotations" lists; a COCO file holds both')
    entries: dict[int, dict[str, Any]] = {}
    for index, entry in enumerate(data["images"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("file_name"), str) and _is_int(entry.get("id"))
                and all(_is_int(entry.get(key)) and entry[key] > 0 for key in ("width", "height"))):
            raise DataError(f"image {index} of {path} needs a file_name, an integer id and a positive width and height")
        if entry["id"] in entries:
            raise DataError(f"image id {entry['id']} appears twice in {path}; give each image its own id")
        entries[entry["id"]] = {**entry, "boxes": [], "labels": []}
    for index, annotation in enumerate(data["annotations"]):
        image_id = annotation.get("image_id") if isinstance(annotation, dict) else None
        image = entries.get(image_id) if _is_int(image_id) else None
        if image is None:
            raise DataError(f"annotation {index} of {path} belongs to no image of the file; give it an image's id")
        box, category = annotation.get("bbox"), annotation.get("category_id")
        if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box) and min(box[2:]) >= 0):
            raise DataError(f"annotation {index} of {path} has bbox {box!r}; a COCO box is [x, y, width, height] "
                            "with a width and height of 0 or more")
        if not _is_int(category) or category < 1:
            raise DataError(f"annotation {index} of {path} has category_id {category!r}; categories are integers "
                            "from 1 (detectors keep 0 for the background)")
        if not annotation.get("iscrowd") and min(box[2:]) > 0:
            x, y, w, h = (float(v) for v in box)
            image["boxes"].append((x, y, x + w, y + h))
            image["labels"].append(category)
    names = [entry["file_name"] for entry in entries.values()]
    if len(set(names)) != len(names):
        raise DataError(f"{path} names an image file twice; give each image entry its own file_name")
    return sorted((CocoImage(_image_path(root, entry["file_name"]), entry["file_name"], entry["width"],
                             entry["height"], tuple(entry["boxes"]), tuple(entry["labels"]))
                   for entry in entries.values()), key=lambda image: image.file_name)


def read_coco(spec: str, split: str, shape: tuple[int, ...],
              samples: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The first ``samples`` images of a ``coco`` spec's ``split``, fitted into input ``shape``, and their boxes.

    Args:
        spec: ``coco:DIR``.
        split: ``train``, ``val`` or ``test``.
        shape: the model's input shape ``N,C,H,W`` (``C`` is 1 or 3).
        samples: how many images at most, in file-name order.

    Returns:
        float32 images ``N×C×H×W`` in [0, 1] (see the module docstring), and per image
        ``{"boxes": G×4 (x1, y1, x2, y2 in those pixels), "labels": G}``.

    Raises:
        DataError: for another kind of spec, a folder :func:`coco_images` refuses (or with fewer
            than 3 images: one per split), or an image that cannot be read or is not the size
            the COCO file gives.
    """
    import torch

    parsed = parse_spec(spec)
    if parsed.kind != "coco":
        raise DataError(f"{spec} holds no boxes, but a detection model is scored on boxes: give --eval coco:DIR "
                        f"(DIR/{ANNOTATIONS} in COCO format and DIR/images/)")
    if len(shape) != 4 or shape[1] not in (1, 3):
        raise DataError(f"COCO folders hold RGB or greyscale images; the model's input shape "
                        f"{','.join(map(str, shape))} is not N,1,H,W or N,3,H,W")
    by_name = {image.file_name: image for image in coco_images(parsed.arg)}
    chosen = [by_name[name] for name in split_names(list(by_name), split, parsed.base)[:samples]]
    images, targets = [], []
    for entry in chosen:
        pixels, scale = _fitted(entry, shape[1], (int(shape[2]), int(shape[3])))
        images.append(pixels)
        targets.append({"boxes": torch.tensor(entry.boxes, dtype=torch.float32).reshape(-1, 4) * scale,
                        "labels": torch.tensor(entry.labels, dtype=torch.int64)})
    return torch.stack(images), targets


def _fitted(entry: CocoImage, channels: int, size: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """The image scaled to fit ``size`` (height, width) with its aspect ratio, zero-padded right and bottom, and
    the scale."""
    import numpy as np
    import torch
    from PIL import Image

    image = open_image(entry.path)
    if image.size != (entry.width, entry.height):
        raise DataError(f"image {entry.path} is {image.size[0]}×{image.size[1]} but {ANNOTATIONS} gives "
                        f"{entry.width}×{entry.height}; its boxes would not fit it")
    scale = min(size[0] / entry.height, size[1] / entry.width)
    width, height = max(1, round(entry.width * scale)), max(1, round(entry.height * scale))
    resized = image.convert("RGB" if channels == 3 else "L").resize((width, height), Image.Resampling.BILINEAR)
    canvas = torch.zeros(channels, *size)
    pixels = np.asarray(resized, dtype=np.float32).reshape(height, width, channels).transpose(2, 0, 1) / 255.0
    canvas[:, :height, :width] = torch.from_numpy(np.ascontiguousarray(pixels))
    return canvas, scale


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path.parent} has no {ANNOTATIONS}; {LAYOUT_HINT}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path} ({e}); give a UTF-8 COCO annotations file") from e


def _image_path(root: Path, file_name: str) -> Path:
    for path in (root / "images" / file_name, root / file_name):
        if path.is_file():
            return path
    raise DataError(f"image {file_name} of {root / ANNOTATIONS} is neither in {root / 'images'} nor in {root}; "
                    "put the images there")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
