"""Segmentation folders (``segfolder:DIR``): images and class masks that score segmentation models (``--eval``).

Layout::

    DIR/images/NAME.jpg   (or .jpeg, .png)
    DIR/masks/NAME.png    one per image, of the same stem and size

A mask is an 8-bit PNG (greyscale, or palette as VOC's masks are) whose pixel
values are class indices; 255 marks pixels that are not scored (object borders
in VOC). Images are split into ``train``, ``val`` and ``test`` by their file
name (see :func:`optkit.data.splits.split_names`). They are resized to the
model's input size (bilinear) and normalized with ImageNet's statistics unless
the spec's query says otherwise (``segfolder:DIR?mean=0.5&std=0.5``); their
masks are resized to the same size with nearest neighbour, so class indices are
never blended.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from optkit.core.errors import DataError
from optkit.data.specs import IMAGENET_MEAN, IMAGENET_STD, parse_spec, per_channel
from optkit.data.splits import split_names

if TYPE_CHECKING:
    import torch

__all__ = ["IMAGE_SUFFIXES", "MASK_MODES", "open_image", "read_segfolder", "segfolder_pairs"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
#: PIL modes of masks that hold one 8-bit class index per pixel.
MASK_MODES = ("L", "P")
LAYOUT_HINT = "give segfolder:DIR with DIR/images/*.jpg|png and DIR/masks/<same name>.png"


def segfolder_pairs(arg: str) -> list[tuple[Path, Path]]:
    """``(image, mask)`` paths of a segmentation folder, sorted by image name, without reading pixels.

    Args:
        arg: what follows ``segfolder:`` (the folder).

    Raises:
        DataError: for a missing folder, no images, or an image without its mask.
    """
    root = Path(arg)
    if not root.is_dir():
        raise DataError(f"segmentation folder {arg} not found; {LAYOUT_HINT}")
    images_dir, masks_dir = root / "images", root / "masks"
    for folder in (images_dir, masks_dir):
        if not folder.is_dir():
            raise DataError(f"{root} has no {folder.name}/ folder; {LAYOUT_HINT}")
    images = sorted(p for p in images_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DataError(f"{images_dir} holds no {', '.join(IMAGE_SUFFIXES)} images; {LAYOUT_HINT}")
    pairs = [(image, masks_dir / f"{image.stem}.png") for image in images]
    missing = next((image for image, mask in pairs if not mask.is_file()), None)
    if missing is not None:
        raise DataError(f"image {missing.name} of {root} has no mask {masks_dir / (missing.stem + '.png')}; "
                        "give every image a class-index PNG of the same name")
    return pairs


def read_segfolder(spec: str, split: str, shape: tuple[int, ...],
                   samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``samples`` images of a ``segfolder`` spec's ``split`` and their masks, at input ``shape``.

    Args:
        spec: ``segfolder:DIR``, with an optional ``?mean=...&std=...`` query.
        split: ``train``, ``val`` or ``test``.
        shape: the model's input shape ``N,C,H,W`` (``C`` is 1 or 3).
        samples: how many images at most, in name order.

    Returns:
        float32 images ``N×C×H×W``, normalized, and uint8 masks ``N×H×W`` (255: not scored).

    Raises:
        DataError: for another kind of spec, a missing or malformed folder (fewer than 3 images: one
            per split), an unreadable image or mask, or a mask that is not 8-bit or not its image's size.
    """
    import numpy as np
    import torch
    from PIL import Image

    parsed = parse_spec(spec)
    if parsed.kind != "segfolder":
        raise DataError(f"{spec} holds no segmentation masks, but a segmentation model is scored on masks: give "
                        "--eval segfolder:DIR (DIR/images/*.jpg|png and DIR/masks/*.png)")
    if len(shape) != 4 or shape[1] not in (1, 3):
        raise DataError(f"segmentation folders hold RGB or greyscale images; the model's input shape "
                        f"{','.join(map(str, shape))} is not N,1,H,W or N,3,H,W")
    pairs = segfolder_pairs(parsed.arg)
    by_name = {image.name: (image, mask) for image, mask in pairs}
    chosen = split_names(list(by_name), split, parsed.base)[:samples]
    channels, size = shape[1], (int(shape[3]), int(shape[2]))
    mean = np.asarray(per_channel(parsed.mean or IMAGENET_MEAN, channels, "mean"), dtype=np.float32)[:, None, None]
    std = np.asarray(per_channel(parsed.std or IMAGENET_STD, channels, "std"), dtype=np.float32)[:, None, None]
    images, masks = [], []
    for name in chosen:
        image, mask = (open_image(path) for path in by_name[name])
        if mask.mode not in MASK_MODES:
            raise DataError(f"mask {by_name[name][1]} is a {mask.mode} image; a mask holds one class index per pixel "
                            "(an 8-bit greyscale or palette PNG)")
        if mask.size != image.size:
            raise DataError(f"mask {by_name[name][1]} is {mask.size[0]}×{mask.size[1]} but its image is "
                            f"{image.size[0]}×{image.size[1]}; a mask has its image's size")
        resized = image.convert("RGB" if channels == 3 else "L").resize(size, Image.Resampling.BILINEAR)
        pixels = np.asarray(resized, dtype=np.float32).reshape(size[1], size[0], channels).transpose(2, 0, 1)
        images.append(torch.from_numpy((pixels / 255.0 - mean) / std))
        masks.append(torch.from_numpy(np.array(mask.resize(size, Image.Resampling.NEAREST), dtype=np.uint8)))
    return torch.stack(images), torch.stack(masks)


def open_image(path: Path):
    """The image at ``path``, read into memory (PIL).

    Raises:
        DataError: for a file that is missing or not an image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(f"cannot read image {path} ({e}); give readable JPEG or PNG files") from e
