"""Dataset specs: one string names a dataset and its normalization everywhere (CLI, recipes, Python).

Kinds:

* ``fashion-mnist`` or ``fashion-mnist:DIR`` — the idx ``.gz`` files of Debian's
  ``dataset-fashion-mnist`` (default ``/usr/share/datasets/fashion-mnist/``);
* ``mnist:DIR`` / ``cifar10:DIR`` — torchvision's datasets under ``DIR``
  (never downloaded);
* ``imagefolder:DIR`` — torchvision ``ImageFolder``; ``DIR`` holds one folder
  per class, or ``train/``, ``val/`` and ``test/`` folders that each do;
* ``synthetic:N[:CxHxW[:K]]`` — ``N`` deterministic images per split of shape
  ``C×H×W`` (default ``3x32x32``) in ``K`` classes (default 10). For tests;
* ``text`` or ``text:FILE|DIR`` — text for language models, tokenized by the
  model's own tokenizer (see :mod:`optkit.data.text`): the Python 3.11
  documentation from Debian's ``python3.11-doc``, or your ``.txt``, ``.rst``
  and ``.md`` files;
* ``segfolder:DIR`` — images and class masks that score segmentation models
  (``DIR/images/*.jpg|png``, ``DIR/masks/*.png``; see :mod:`optkit.data.segfolder`);
* ``coco:DIR`` — images and COCO boxes that score detection models
  (``DIR/annotations.json``, ``DIR/images/``; see :mod:`optkit.data.coco`).

Any image spec but ``coco`` may end in a query that sets the normalization the images get,
``(x - mean) / std`` on the 0-1 scale, one value or one per channel:
``fashion-mnist?mean=0&std=1`` (plain 0-1 tensors, as ``ToTensor()`` alone
gives), ``imagefolder:DIR?mean=0.5,0.5,0.5&std=0.5,0.5,0.5``. Without it each
dataset uses its own statistics (ImageNet's for image folders); a model
trained under another normalization scores near chance, so say which one it
was trained with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from optkit.core.errors import DataError

KINDS = ("fashion-mnist", "imagefolder", "mnist", "cifar10", "synthetic", "text", "segfolder", "coco")
SPEC_FORMS = ("fashion-mnist[:DIR], imagefolder:DIR, mnist:DIR, cifar10:DIR, synthetic:N[:CxHxW[:K]], text[:FILE|DIR], "
              "segfolder:DIR, coco:DIR")
#: Specs that score one model kind on data (``--eval``) and hold no class labels, with what they hold.
SCORING_ONLY = {"segfolder": "images and class masks that score segmentation models",
                "coco": "images and boxes that score detection models"}
#: Kinds whose argument may be left out (a default location).
OPTIONAL_ARG = ("fashion-mnist", "text")
#: Keys a spec's query may set.
QUERY_KEYS = ("mean", "std")
IMAGEFOLDER_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset.

    Attributes:
        num_classes: number of labels.
        channels: image channels (1 for grey, 3 for RGB).
        image_size: ``(height, width)`` of the images the dataset yields.
        mean: per-channel normalization mean the images get (the spec's query,
            else the dataset's own statistics), on the 0-1 scale.
        std: per-channel normalization std the images get.
    """

    num_classes: int
    channels: int
    image_size: tuple[int, int]
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def input_shape(self, batch: int = 1) -> tuple[int, int, int, int]:
        """The model input shape ``(batch, C, H, W)``."""
        return (batch, self.channels, *self.image_size)

    def normalization(self) -> dict[str, str]:
        """The normalization as strings, for reports and ONNX metadata.

        Returns:
            ``{"mean": "0.286", "std": "0.353"}``, comma-separated per channel,
            in the form a spec's query takes.
        """
        return {"mean": _join(self.mean), "std": _join(self.std)}


@dataclass(frozen=True)
class DataSpec:
    """A parsed dataset spec.

    Attributes:
        kind: one of :data:`KINDS`.
        arg: what follows ``kind:`` (a directory, synthetic sizes), or ``""``.
        mean: the query's normalization mean (as given: one value or one per channel), or ``None``.
        std: the query's normalization std, or ``None``.
    """

    kind: str
    arg: str
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def base(self) -> str:
        """The spec without its query, e.g. ``fashion-mnist`` or ``imagefolder:DIR``."""
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


@dataclass(frozen=True)
class _Known:
    info: DatasetInfo
    pad: int
    flip: bool


#: Datasets with fixed sizes and published statistics, and their training augmentation.
KNOWN = {
    "fashion-mnist": _Known(DatasetInfo(10, 1, (28, 28), (0.2860,), (0.3530,)), pad=2, flip=True),
    "mnist": _Known(DatasetInfo(10, 1, (28, 28), (0.1307,), (0.3081,)), pad=2, flip=False),
    "cifar10": _Known(DatasetInfo(10, 3, (32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
                      pad=4, flip=True),
}


def parse_spec(spec: str) -> DataSpec:
    """Parse a dataset spec, with its optional ``?mean=...&std=...`` query.

    Args:
        spec: e.g. ``fashion-mnist``, ``imagefolder:DIR?mean=0.5&std=0.5``, ``text``.

    Returns:
        the :class:`DataSpec`.

    Raises:
        DataError: for an unknown kind, a missing argument, or a query with an
            unknown or repeated key or a value that is not numbers.
    """
    text, has_query, query = str(spec).partition("?")
    kind, _, arg = text.partition(":")
    if kind not in KINDS:
        raise DataError(f"unknown dataset spec {spec!r}; use one of: {SPEC_FORMS} (optionally ?mean=M&std=S)")
    if kind not in OPTIONAL_ARG and not arg:
        raise DataError(f"dataset spec {spec!r} needs an argument, e.g. {kind}:{'64' if kind == 'synthetic' else 'DIR'}")
    if kind == "text" and has_query:
        raise DataError(f"text specs take no query (mean/std normalize images), got {spec!r}; give text[:FILE|DIR]")
    if kind == "coco" and has_query:
        raise DataError(f"coco specs take no query (detection models normalize their images themselves), got {spec!r}; "
                        "give coco:DIR")
    values = _parse_query(spec, query) if has_query else {}
    return DataSpec(kind, arg, values.get("mean"), values.get("std"))


def _parse_query(spec: str, query: str) -> dict[str, tuple[float, ...]]:
    values: dict[str, tuple[float, ...]] = {}
    for item in query.split("&"):
        key, has_value, value = item.partition("=")
        if key not in QUERY_KEYS:
            raise DataError(f"unknown key {key!r} in dataset spec {spec!r}; valid keys: {', '.join(QUERY_KEYS)} "
                            "(e.g. fashion-mnist?mean=0&std=1)")
        if key in values:
            raise DataError(f"{key} is given twice in dataset spec {spec!r}; give it once")
        try:
            numbers = tuple(float(v) for v in value.split(","))
        except ValueError:
            numbers = ()
        if not has_value or not numbers:
            raise DataError(f"{key} in dataset spec {spec!r} must be one number or one per channel, "
                            f"comma-separated (e.g. {key}=0.5 or {key}=0.5,0.5,0.5), got {value!r}")
        values[key] = numbers
    return values


def per_channel(values: Sequence[float] | float, channels: int, what: str) -> tuple[float, ...]:
    """Normalization values, one per channel (a single value applies to every channel).

    Args:
        values: one number or one per channel.
        channels: the images' channels.
        what: ``"mean"`` or ``"std"`` (std must be positive).

    Returns:
        ``channels`` floats.

    Raises:
        DataError: for a count that is neither 1 nor ``channels``, or a std that is not positive.
    """
    values = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise DataError(f"{what} needs 1 or {channels} values for {channels}-channel images, got {len(values)}")
    if what == "std" and any(v <= 0 for v in values):
        raise DataError(f"std values must be positive, got {values}")
    return tuple(values)


def dataset_info(spec: str) -> DatasetInfo:
    """Classes, channels, image size and normalization of the dataset ``spec`` names, without loading its images.

    Args:
        spec: a dataset spec (see the module docstring).

    Returns:
        the :class:`DatasetInfo`; its ``mean``/``std`` are the query's when
        given, else the dataset's own, one value per channel.

    Raises:
        DataError: for a bad spec or normalization, an image folder that is missing or empty,
            a ``text`` spec (text has no classes or images), or a ``segfolder``/``coco`` spec
            (they hold masks or boxes, not class labels).
    """
    parsed = parse_spec(spec)
    if is_text(parsed):
        raise DataError(f"{spec} is text for language models, not labelled images; give an image dataset spec "
                        "for an image model")
    if parsed.kind in SCORING_ONLY:
        raise DataError(f"{spec} holds {SCORING_ONLY[parsed.kind]} (--eval), not labelled images; give a "
                        "classification spec here (imagefolder:DIR, ...)")
    if parsed.kind in KNOWN:
        info = KNOWN[parsed.kind].info
    elif parsed.kind == "synthetic":
        _, channels, size, classes = synthetic_args(parsed.arg)
        info = DatasetInfo(classes, channels, size, (0.5,), (0.25,))
    else:
        info = DatasetInfo(len(folder_classes(parsed.arg)), 3, (IMAGEFOLDER_SIZE, IMAGEFOLDER_SIZE),
                           IMAGENET_MEAN, IMAGENET_STD)
    mean = info.mean if parsed.mean is None else parsed.mean
    std = info.std if parsed.std is None else parsed.std
    return DatasetInfo(info.num_classes, info.channels, info.image_size,
                       per_channel(mean, info.channels, "mean"), per_channel(std, info.channels, "std"))


def is_text(spec: str | DataSpec) -> bool:
    """Whether a spec (a string or parsed) names text for language models (``text``, ``text:FILE|DIR``)."""
    return (spec if isinstance(spec, DataSpec) else parse_spec(spec)).kind == "text"


def synthetic_args(arg: str) -> tuple[int, int, tuple[int, int], int]:
    """``(N, C, (H, W), K)`` of a ``synthetic:N[:CxHxW[:K]]`` spec's argument.

    Raises:
        DataError: for anything but positive sizes and at least 2 classes.
    """
    parts = arg.split(":")
    try:
        n = int(parts[0])
        c, h, w = (int(v) for v in parts[1].split("x")) if len(parts) > 1 else (3, 32, 32)
        k = int(parts[2]) if len(parts) > 2 else 10
        ok = len(parts) <= 3 and min(n, c, h, w) > 0 and k >= 2
    except ValueError:
        ok = False
    if not ok:
        raise DataError(f"bad synthetic spec 'synthetic:{arg}'; use synthetic:N[:CxHxW[:K]], "
                        "e.g. synthetic:64:3x32x32:10 (positive sizes, K >= 2 classes)")
    return n, c, (h, w), k


def folder_classes(directory: str) -> list[str]:
    """The class names of an image folder (its sub-folders, or those of its ``train/``).

    Raises:
        DataError: for a missing folder or one without class sub-folders.
    """
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"image folder {directory} not found; give imagefolder:DIR with one sub-folder per class")
    base = root / "train" if (root / "train").is_dir() else root
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"image folder {base} has no class sub-folders; put images in DIR/CLASS_NAME/*.jpg")
    return classes


def _join(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)
