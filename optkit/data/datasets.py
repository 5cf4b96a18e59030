"""Dataset specs -> torch Datasets, and a DataLoader whose worker count is chosen by measurement.

Specs (one string names a dataset everywhere: CLI, recipes, Python):

* ``fashion-mnist`` or ``fashion-mnist:DIR`` — the idx ``.gz`` files of Debian's
  ``dataset-fashion-mnist`` (default ``/usr/share/datasets/fashion-mnist/``),
  decoded directly into memory;
* ``mnist:DIR`` / ``cifar10:DIR`` — torchvision's datasets under ``DIR``
  (never downloaded);
* ``imagefolder:DIR`` — torchvision ``ImageFolder``; ``DIR`` holds one folder
  per class, or ``train/``, ``val/`` and ``test/`` folders that each do;
* ``synthetic:N[:CxHxW[:K]]`` — ``N`` deterministic images per split of shape
  ``C×H×W`` (default ``3x32x32``) in ``K`` classes (default 10), each class a
  fixed random pattern plus noise, so a model can learn it. For tests.

Splits: ``train`` (augmented), ``val`` (held out of the training files,
the same images for a given ``seed``) and ``test``. Images are normalized with
the dataset's own statistics unless ``mean``/``std`` are given.

In-memory datasets (Fashion-MNIST, MNIST, CIFAR-10, synthetic) keep uint8
tensors and transform a whole batch at once with array ops (no PIL), so
loading a batch costs about a millisecond and needs no worker processes.
"""

from __future__ import annotations

import gzip
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
import torch
from torch.utils.data import DataLoader, Dataset

from optkit.core.errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_HINT = "install it with `apt-get install dataset-fashion-mnist` or give fashion-mnist:DIR"
#: Images held out of the training files for the ``val`` split (at most a tenth of them).
VAL_SIZE = 5000
IMAGEFOLDER_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset.

    Attributes:
        num_classes: number of labels.
        channels: image channels (1 for grey, 3 for RGB).
        image_size: ``(height, width)`` of the images the dataset yields.
        mean: per-channel normalization mean used by default.
        std: per-channel normalization std used by default.
    """

    num_classes: int
    channels: int
    image_size: tuple[int, int]
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def input_shape(self, batch: int = 1) -> tuple[int, int, int, int]:
        """The model input shape ``(batch, C, H, W)``."""
        return (batch, self.channels, *self.image_size)


@dataclass(frozen=True)
class _Known:
    info: DatasetInfo
    pad: int
    flip: bool


_KNOWN = {
    "fashion-mnist": _Known(DatasetInfo(10, 1, (28, 28), (0.2860,), (0.3530,)), pad=2, flip=True),
    "mnist": _Known(DatasetInfo(10, 1, (28, 28), (0.1307,), (0.3081,)), pad=2, flip=False),
    "cifar10": _Known(DatasetInfo(10, 3, (32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
                      pad=4, flip=True),
}


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
        self.mean = _per_channel(mean, channels, "mean")
        self.std = _per_channel(std, channels, "std")
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


def _per_channel(values: Sequence[float] | float, channels: int, what: str) -> np.ndarray:
    values = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise DataError(f"{what} needs 1 or {channels} values for {channels}-channel images, got {len(values)}")
    if what == "std" and any(v <= 0 for v in values):
        raise DataError(f"std values must be positive, got {values}")
    return np.asarray(values, dtype=np.float32)[:, None, None]


def _random_crop(batch: np.ndarray, pad: int) -> np.ndarray:
    n, _, h, w = batch.shape
    padded = np.pad(batch, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n)).numpy()
    return sliding_window_view(padded, (h, w), axis=(2, 3))[np.arange(n), :, dy, dx]


# --- specs ---------------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str]:
    """Split a dataset spec into ``(kind, argument)``.

    Raises:
        DataError: for an unknown kind or a missing argument.
    """
    kind, _, arg = str(spec).partition(":")
    kinds = ("fashion-mnist", "imagefolder", "mnist", "cifar10", "synthetic")
    if kind not in kinds:
        raise DataError(f"unknown dataset spec {spec!r}; use one of: fashion-mnist[:DIR], imagefolder:DIR, "
                        "mnist:DIR, cifar10:DIR, synthetic:N[:CxHxW[:K]]")
    if kind != "fashion-mnist" and not arg:
        raise DataError(f"dataset spec {spec!r} needs an argument, e.g. {kind}:{'64' if kind == 'synthetic' else 'DIR'}")
    return kind, arg


def dataset_info(spec: str) -> DatasetInfo:
    """Classes, channels and image size of the dataset ``spec`` names, without loading its images.

    Raises:
        DataError: for a bad spec, or an image folder that is missing or empty.
    """
    kind, arg = parse_spec(spec)
    if kind in _KNOWN:
        return _KNOWN[kind].info
    if kind == "synthetic":
        _, channels, size, classes = _synthetic_args(arg)
        return DatasetInfo(classes, channels, size, (0.5,) * channels, (0.25,) * channels)
    return DatasetInfo(len(_folder_classes(arg)), 3, (IMAGEFOLDER_SIZE, IMAGEFOLDER_SIZE), IMAGENET_MEAN, IMAGENET_STD)


def load_dataset(spec: str, split: str = "train", *, mean: Sequence[float] | float | None = None,
                 std: Sequence[float] | float | None = None, seed: int = 0, augment: bool | None = None) -> Dataset:
    """The ``split`` of the dataset ``spec`` names, as a map-style Dataset of ``(image, label)``.

    Args:
        spec: a dataset spec (see the module docstring).
        split: ``train``, ``val`` (held out of the training files) or ``test``.
        mean: normalization mean override (one value or one per channel).
        std: normalization std override.
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
    kind, arg = parse_spec(spec)
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
    known = _KNOWN.get(kind)
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


def _synthetic_args(arg: str) -> tuple[int, int, tuple[int, int], int]:
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


def _synthetic(arg: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, c, (h, w), k = _synthetic_args(arg)
    patterns = torch.randint(0, 256, (k, c, h, w), generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(SPLITS.index(split) + 1)
    labels = torch.randint(0, k, (n,), generator=g)
    noise = torch.randint(-48, 49, (n, c, h, w), generator=g)
    images = (patterns[labels] + noise).clamp_(0, 255).to(torch.uint8)
    return images, labels


def _folder_classes(directory: str) -> list[str]:
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"image folder {directory} not found; give imagefolder:DIR with one sub-folder per class")
    base = root / "train" if (root / "train").is_dir() else root
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"image folder {base} has no class sub-folders; put images in DIR/CLASS_NAME/*.jpg")
    return classes


def _image_folder(directory: str, split: str, mean, std, seed: int, augment: bool) -> Dataset:
    from torchvision import datasets, transforms

    _folder_classes(directory)
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


# --- loader --------------------------------------------------------------------------------------


@dataclass
class LoaderChoice:
    """What :func:`make_loader` chose and why.

    Attributes:
        num_workers: worker processes (0: load in the main process).
        pin_memory: page-locked host memory (on for CUDA).
        persistent_workers: keep workers alive between epochs.
        prefetch_factor: batches each worker loads ahead (``None`` without workers).
        tuned: whether ``num_workers`` was chosen by measurement.
        batches_per_s: measured loading rate per candidate worker count.
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    tuned: bool
    batches_per_s: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs and reports."""
        how = "measured" if self.tuned else "given"
        rates = ", ".join(f"{w}: {r:.0f}" for w, r in self.batches_per_s.items())
        tail = f" (batches/s by workers: {rates})" if rates else ""
        return f"num_workers={self.num_workers} ({how}), pin_memory={self.pin_memory}{tail}"


#: Seconds spent timing all candidate worker counts together.
TUNE_BUDGET_S = 3.0
#: Batches timed per candidate after one warm-up batch.
TUNE_BATCHES = 12
#: A worker count must load this much faster than the main process to be chosen:
#: workers share the CPU cores with the training step, which the timing does not see.
WORKER_MARGIN = 1.25


def worker_candidates() -> list[int]:
    """Worker counts tried by the tuner: 0, 1, 2, 4, ... up to the usable CPU cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates, n = [0], 1
    while n <= cores:
        candidates.append(n)
        n *= 2
    return candidates


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = False, num_workers: int | str = "auto",
                device: str | torch.device | None = None, drop_last: bool = False, sampler: Any = None,
                seed: int | None = None, budget_s: float = TUNE_BUDGET_S) -> DataLoader:
    """A DataLoader with ``num_workers`` chosen by timing a few batches per candidate.

    Each candidate in :func:`worker_candidates` loads a few batches within
    ``budget_s`` seconds in all; the fewest workers whose rate is within reach of
    the best wins, and a worker count must beat loading in the main process by
    :data:`WORKER_MARGIN`. Memory is pinned when ``device`` is CUDA; workers
    persist between epochs and prefetch 2 batches each. The choice is logged
    and kept on the loader as ``loader.optkit_choice`` (a :class:`LoaderChoice`).

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        shuffle: reshuffle every epoch (ignored when ``sampler`` is given).
        num_workers: ``"auto"`` to measure, or an explicit count that always wins.
        device: where batches go; CUDA turns on ``pin_memory``.
        drop_last: drop the last incomplete batch.
        sampler: a custom sampler (e.g. ``DistributedSampler``).
        seed: seeds the shuffling order for reproducible epochs.
        budget_s: time budget for the measurement.

    Returns:
        the configured DataLoader, with ``optkit_choice`` attached.

    Raises:
        ValueError: for a non-positive batch size or a bad ``num_workers``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_workers != "auto" and (not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0):
        raise ValueError(f"num_workers must be 'auto' or an integer >= 0, got {num_workers!r}")
    pin = torch.device(device).type == "cuda" if device is not None else False
    rates: dict[int, float] = {}
    if num_workers == "auto":
        rates = _time_candidates(dataset, batch_size, pin, budget_s)
        workers = _pick(rates)
    else:
        workers = num_workers
    choice = LoaderChoice(workers, pin, workers > 0, 2 if workers > 0 else None, num_workers == "auto", rates)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
                        num_workers=workers, pin_memory=pin, drop_last=drop_last, generator=generator,
                        persistent_workers=choice.persistent_workers, prefetch_factor=choice.prefetch_factor)
    loader.optkit_choice = choice
    log.info("data loader: %s", choice.describe())
    return loader


def _pick(rates: dict[int, float]) -> int:
    baseline = rates.get(0, 0.0)
    best = max(rates, key=lambda w: rates[w])
    if best == 0 or rates[best] < WORKER_MARGIN * baseline:
        return 0
    # Fewest workers within 10% of the best: extra workers only take cores from the training step.
    return min(w for w, r in rates.items() if r >= 0.9 * rates[best])


def _time_candidates(dataset: Dataset, batch_size: int, pin: bool, budget_s: float) -> dict[int, float]:
    candidates = worker_candidates()
    batches = max(2, min(TUNE_BATCHES + 1, len(dataset) // batch_size))
    rates: dict[int, float] = {}
    deadline = time.perf_counter() + budget_s
    for workers in candidates:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        sampler = torch.utils.data.RandomSampler(dataset, num_samples=min(len(dataset), batches * batch_size),
                                                 generator=torch.Generator().manual_seed(0))
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
                            prefetch_factor=2 if workers else None)
        rates[workers] = _batches_per_second(loader, time.perf_counter() + remaining / (len(candidates) - len(rates)))
    return rates


def _batches_per_second(loader: DataLoader, stop_at: float) -> float:
    iterator = iter(loader)
    try:
        next(iterator)  # the warm-up batch pays worker start-up, which persistent workers pay once
        start, count = time.perf_counter(), 0
        for _ in iterator:
            count += 1
            if time.perf_counter() >= stop_at:
                break
        elapsed = time.perf_counter() - start
    finally:
        del iterator
    return count / elapsed if count and elapsed > 0 else 0.0
