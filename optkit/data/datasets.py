"""Datasets behind the specs of :mod:`optkit.data.specs`: readers, ``TensorImageDataset`` and :func:`load_dataset`.

Labelled image datasets only: ``text`` specs are read as blocks of token ids by
:func:`optkit.data.text.token_blocks`, with the model's tokenizer; ``segfolder``
and ``coco`` specs, which score segmentation and detection models, by
:mod:`optkit.data.segfolder` and :mod:`optkit.data.coco`.

Splits: ``train`` (augmented), ``val`` (held out of the training files,
the same images for a given ``seed``) and ``test``. Images are normalized as
the spec says (its ``?mean=...&std=...`` query, else the dataset's own
statistics) unless ``mean``/``std`` are passed to :func:`load_dataset`.

In-memory datasets (Fashion-MNIST, MNIST, CIFAR-10, synthetic) keep uint8
tensors and transform a whole batch at once with array ops (no PIL), so
loading a batch costs about a millisecond and needs no worker processes.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch.utils.data import Dataset

from optkit.core.errors import DataError
from optkit.data.coco import coco_images
from optkit.data.segfolder import segfolder_pairs
from optkit.data.specs import (IMAGEFOLDER_SIZE, KNOWN, dataset_info, folder_classes, is_text, parse_spec,
                               per_channel, synthetic_args)
from optkit.data.text import text_files

SPLITS = ("train", "val", "test")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_HINT = "install it with `apt-get install dataset-fashion-mnist` or give fashion-mnist:DIR"
#: Images held out of the training files for the ``val`` split (at most a tenth of them).
VAL_SIZE = 5000

_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


class TensorImageDataset(Dataset):
    """Images held as a uint8 ``N×C×H×W`` tensor, transformed a batch at a time.

    ``DataLoader`` calls :meth:`__getitems__` with a whole batch of indices, so
    the random crop, flip and normalization run once per batch as array ops.

    Args:
        images: uint8 tensor ``N×C×H×W``.
        labels: int64 tensor ``N``.
        mean: per-channel mean (one value broadcasts to every channel), on the 0-1 scale.
        std: per-channel std, on the 0-1 scale.
        pad: training augmentation: random crop after zero padding by this many pixels (0: none).
        flip: training augmentation: random horizontal flip.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, mean: Sequence[float],
                 std: Sequence[float], pad: int = 0, flip: bool = False):
        if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(labels):
            raise DataError(f"expected uint8 N×C×H×W images and N labels, got {tuple(images.shape)} "
                            f"{images.dtype} and {len(labels)} labels")
        self.images = images
        self.labels = labels.long()
        channels = images.shape[1]
        self.mean = np.asarray(per_channel(mean, channels, "mean"), dtype=np.float32)[:, None, None]
        self.std = np.asarray(per_channel(std, channels, "std"), dtype=np.float32)[:, None, None]
        self._images = images.numpy()
        self._scale = 1.0 / (255.0 * self.std)
        self._offset = self.mean / self.std
        self.pad = pad
        self.flip = flip

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.__getitems__([index])[0]
        return image, int(label)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # numpy, not torch: numpy runs these small ops on one thread, while torch's
        # intra-op threads cost more to synchronise than the work on a busy CPU
        # (measured: 16 ms vs 0.3 ms to scale one 256-image batch). Random draws
        # use torch's generator, which DataLoader seeds differently in each worker.
        index = np.asarray(indices, dtype=np.int64)
        batch = self._images[index]
        if self.pad:
            batch = _random_crop(batch, self.pad)
        if self.flip:
            flipped = torch.rand(len(batch)).numpy() < 0.5
            batch[flipped] = batch[flipped][..., ::-1]
        x = batch.astype(np.float32)
        x *= self._scale
        x -= self._offset
        return list(zip(torch.from_numpy(x).unbind(0), self.labels[torch.from_numpy(index)].unbind(0)))


def _random_crop(batch: np.ndarray, pad: int) -> np.ndarray:
    n, _, h, w = batch.shape
    padded = np.pad(batch, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n)).numpy()
    return sliding_window_view(padded, (h, w), axis=(2, 3))[np.arange(n), :, dy, dx]


def load_dataset(spec: str, split: str = "train", *, mean: Sequence[float] | float | None = None,
                 std: Sequence[float] | float | None = None, seed: int = 0, augment: bool | None = None) -> Dataset:
    """The ``split`` of the dataset ``spec`` names, as a map-style Dataset of ``(image, label)``.

    Args:
        spec: a dataset spec (see :mod:`optkit.data.specs`), e.g. ``fashion-mnist?mean=0&std=1``.
        split: ``train``, ``val`` (held out of the training files) or ``test``.
        mean: normalization mean (one value or one per channel), over the spec's query.
        std: normalization std, over the spec's query.
        seed: chooses which training images are held out for ``val``.
        augment: random crop/flip; by default on for ``train`` only.

    Returns:
        a Dataset yielding normalized float images ``C×H×W`` and integer labels.

    Raises:
        DataError: for a bad spec or split, or missing or malformed files
            (the message says how to get them).
    """
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    parsed = parse_spec(spec)
    kind, arg = parsed.kind, parsed.arg
    info = dataset_info(spec)
    augment = split == "train" if augment is None else augment
    mean = info.mean if mean is None else mean
    std = info.std if std is None else std
    if kind == "imagefolder":
        return _image_folder(arg, split, mean, std, seed, augment)
    if kind == "synthetic":
        images, labels = _synthetic(arg, split)
    else:
        images, labels = _split_arrays(_read_arrays(kind, arg, "test" if split == "test" else "train"), split, seed)
    known = KNOWN.get(kind)
    pad = (known.pad if known else 2) if augment else 0
    flip = bool(known.flip if known else True) and augment
    return TensorImageDataset(images, labels, mean=mean, std=std, pad=pad, flip=flip)


def _split_arrays(arrays: tuple[torch.Tensor, torch.Tensor], split: str, seed: int):
    images, labels = arrays
    if split == "test":
        return images, labels
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    held = max(1, min(VAL_SIZE, len(images) // 10))
    chosen = order[:held] if split == "val" else order[held:].sort().values
    return images[chosen], labels[chosen]


def check_available(spec: str) -> None:
    """Check, without reading the images, that the dataset ``spec`` names is there (called before any pass runs).

    Raises:
        DataError: for a malformed spec, or files or folders that are missing (a segmentation
            folder's image without its mask, a COCO folder without its annotations or images...).
    """
    parsed = parse_spec(spec)
    if is_text(parsed):
        text_files(parsed.arg)
        return
    if parsed.kind == "segfolder":
        segfolder_pairs(parsed.arg)
        return
    if parsed.kind == "coco":
        coco_images(parsed.arg)
        return
    dataset_info(spec)
    if parsed.kind == "fashion-mnist":
        directory = Path(parsed.arg or FASHION_MNIST_DIR)
        missing = [name for names in _FMNIST_FILES.values() for name in names if not (directory / name).is_file()]
        if missing:
            raise DataError(f"Fashion-MNIST file {directory / missing[0]} not found; {FASHION_MNIST_HINT}")
    elif parsed.kind in KNOWN and not Path(parsed.arg).is_dir():
        raise DataError(f"{parsed.kind} folder {parsed.arg!r} not found; give {parsed.kind}:DIR with torchvision's files")


def _read_arrays(kind: str, arg: str, files: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "fashion-mnist":
        return _read_fashion_mnist(arg or FASHION_MNIST_DIR, files)
    return _read_torchvision(kind, arg, files == "train")


@lru_cache(maxsize=4)
def _read_fashion_mnist(directory: str, files: str) -> tuple[torch.Tensor, torch.Tensor]:
    image_file, label_file = (Path(directory) / name for name in _FMNIST_FILES[files])
    images = _read_idx(image_file, _IDX_IMAGES_MAGIC, 3)
    labels = _read_idx(label_file, _IDX_LABELS_MAGIC, 1)
    if len(images) != len(labels):
        raise DataError(f"Fashion-MNIST in {directory} is malformed: {len(images)} images but {len(labels)} labels; "
                        f"{FASHION_MNIST_HINT}")
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def _read_idx(path: Path, magic: int, dims: int) -> np.ndarray:
    """Decode an idx file (big-endian magic, dims, then uint8 data), checking its header and size."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise DataError(f"Fashion-MNIST file {path} not found; {FASHION_MNIST_HINT}") from e
    except (OSError, EOFError) as e:
        raise DataError(f"Fashion-MNIST file {path} is not a readable gzip file ({e}); {FASHION_MNIST_HINT}") from e
    header = 4 + 4 * dims
    if len(raw) < header or int.from_bytes(raw[:4], "big") != magic:
        raise DataError(f"Fashion-MNIST file {path} is malformed (bad idx header); {FASHION_MNIST_HINT}")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    if len(raw) - header != int(np.prod(shape)):
        raise DataError(f"Fashion-MNIST file {path} is malformed: header says {shape}, "
                        f"data has {len(raw) - header} bytes; {FASHION_MNIST_HINT}")
    return np.frombuffer(bytearray(raw), dtype=np.uint8, offset=header).reshape(shape)


@lru_cache(maxsize=4)
def _read_torchvision(kind: str, root: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision import datasets

    cls = datasets.MNIST if kind == "mnist" else datasets.CIFAR10
    try:
        ds = cls(root=root, train=train, download=False)
    except RuntimeError as e:
        raise DataError(f"{kind} not found under {root}; put torchvision's {cls.__name__} files there "
                        f"(e.g. torchvision.datasets.{cls.__name__}(root={root!r}, download=True) on a "
                        "machine with internet)") from e
    if kind == "mnist":
        return ds.data.unsqueeze(1).contiguous(), ds.targets.long()
    return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets, dtype=torch.long)


def _synthetic(arg: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, c, (h, w), k = synthetic_args(arg)
    patterns = torch.randint(0, 256, (k, c, h, w), generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(SPLITS.index(split) + 1)
    labels = torch.randint(0, k, (n,), generator=g)
    noise = torch.randint(-48, 49, (n, c, h, w), generator=g)
    images = (patterns[labels] + noise).clamp_(0, 255).to(torch.uint8)
    return images, labels


def _image_folder(directory: str, split: str, mean, std, seed: int, augment: bool) -> Dataset:
    from torchvision import datasets, transforms

    folder_classes(directory)
    size = IMAGEFOLDER_SIZE
    if augment:
        steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
    else:
        steps = [transforms.Resize(int(size * 256 / 224)), transforms.CenterCrop(size)]
    transform = transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(list(mean), list(std))])
    root = Path(directory)
    split_dirs = (root / "train").is_dir()
    folder = root / split if split_dirs and (root / split).is_dir() else root / "train" if split_dirs else root
    try:
        ds = datasets.ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"image folder {folder} has no readable images ({e}); put images in DIR/CLASS_NAME/*.jpg") from e
    if split_dirs and (root / split).is_dir():
        return ds
    # No folder for this split: hold out a deterministic 10% of the training images for val and test.
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, len(ds) // 10)
    return torch.utils.data.Subset(ds, sorted(order[held:]) if split == "train" else order[:held])
