"""Batches that calibrate and check an INT8 model: from a dataset spec, adapted to the model's input, or random.

Images go through the same loaders as training (:func:`optkit.data.load_dataset`)
without augmentation, and are repeated/averaged to the model's channel count and
resized to its input size exactly as the fine-tune stage does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optkit.core.errors import DataError

NO_DATA = ("INT8 quantization needs images like the ones the model will see, to calibrate and check it: give "
           "--calib-data SPEC (e.g. the training set); random inputs set activation ranges unlike real images', so "
           "the INT8 model's accuracy would be meaningless (--random-calibration allows it, for timing only)")


@dataclass
class Batches:
    """Model inputs and, when the data has them, labels.

    Attributes:
        inputs: float32 arrays shaped like the model input, batch first (for a model of several inputs, a feed
            of every input by name per batch).
        labels: one int64 array per batch, or ``None`` for random inputs.
        source: the dataset spec and split, or ``"random"``.
    """

    inputs: list[np.ndarray]
    labels: list[np.ndarray] | None
    source: str

    @property
    def samples(self) -> int:
        return sum(len(next(iter(x.values())) if isinstance(x, dict) else x) for x in self.inputs)


def load_batches(spec: str | None, split: str, input_shape: Sequence[int], *, batch_size: int, samples: int,
                 random: bool = False, seed: int = 0) -> Batches:
    """Up to ``samples`` inputs for a model taking ``input_shape``, ``batch_size`` at a time.

    Args:
        spec: dataset spec, or ``None`` with ``random``.
        split: ``train``, ``val`` or ``test``.
        input_shape: the model input shape (batch first).
        batch_size: inputs per batch.
        samples: how many inputs in all (fewer when the split is smaller).
        random: standard-normal inputs instead of data (``spec`` must be ``None``).
        seed: seed of the random inputs and of the order images are drawn in.

    Returns:
        the :class:`Batches`.

    Raises:
        DataError: with no data and no ``random``, for an empty split, or images whose channels do not fit the model.
    """
    shape = tuple(int(v) for v in input_shape)
    if spec is None:
        if not random:
            raise DataError(NO_DATA)
        rng = np.random.default_rng(seed)
        sizes = [min(batch_size, samples - start) for start in range(0, samples, batch_size)]
        return Batches([rng.standard_normal((n, *shape[1:]), dtype=np.float32) for n in sizes], None, "random")
    import torch

    from optkit.data.datasets import load_dataset
    from optkit.data.adapt import adapted

    dataset = load_dataset(spec, split, augment=False)
    if len(dataset) == 0:
        raise DataError(f"the {split} split of {spec} has no images; calibration needs at least one batch "
                        "(give a larger dataset with --calib-data)")
    dataset = adapted(dataset, shape)
    count = min(samples, len(dataset))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count].sort().values.tolist()
    inputs, labels = [], []
    for start in range(0, count, batch_size):
        indices = order[start:start + batch_size]
        items = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
        images = torch.stack([image for image, _ in items]).numpy().astype(np.float32, copy=False)
        if images.shape[1:] != shape[1:]:
            raise DataError(f"{spec} gives images shaped {images.shape[1:]} but the model takes {shape[1:]}; "
                            "set --input-shape to the model's input or use data that fits it")
        inputs.append(np.ascontiguousarray(images))
        labels.append(np.asarray([int(label) for _, label in items], dtype=np.int64))
    return Batches(inputs, labels, f"{spec} ({split})")


def calibration_reader(batches: Batches, input_name: str):
    """An ONNX Runtime ``CalibrationDataReader`` that feeds ``batches`` to the input ``input_name``."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._items = iter(batches.inputs)

        def get_next(self):
            item = next(self._items, None)
            return None if item is None else {input_name: item}

        def __len__(self) -> int:
            return len(batches.inputs)

        def rewind(self) -> None:
            self._items = iter(batches.inputs)

    return _Reader()
