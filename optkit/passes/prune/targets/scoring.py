"""Pruned copies scored on data: BatchNorm re-estimated on training images, then scored on validation images.

Cutting channels changes what every later BatchNorm sees; a copy scored with the
unpruned model's statistics can sit near chance and recover most of its accuracy
once they are re-estimated, so copies are compared recalibrated (only statistics
change, no weights). Used where a target chooses among pruned copies by what
they score (:mod:`optkit.passes.prune.targets.latency`) and by the sensitivity
curves (:mod:`optkit.passes.prune.targets.curves`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

#: The split that scores pruned copies (the test split stays for reports).
SCORE_SPLIT = "val"


def calibration_images(data: str, shape: tuple[int, ...], samples: int, batch_size: int) -> list:
    """The first ``samples`` training images of ``data``, adapted to ``shape``, in batches (empty for 0 samples)."""
    import torch

    from optkit.data import load_dataset
    from optkit.data.adapt import adapted

    if not samples:
        return []
    dataset = adapted(load_dataset(data, "train", augment=False), shape)
    count = min(samples, len(dataset))
    images = torch.stack([dataset[i][0] for i in range(count)])
    return list(images.split(batch_size))


def copy_scorer(model: nn.Module, shape: tuple[int, ...], data: str, *, samples: int = 512,
                calibration_samples: int = 256, batch_size: int = 128) -> Callable[[nn.Module], dict[str, Any]]:
    """A function scoring a pruned copy of ``model``: its BatchNorm statistics re-estimated (in place) on
    ``calibration_samples`` training images, then its kind's scores on the first ``samples`` validation images,
    agreement with ``model`` included.

    Raises:
        DataError: for a missing dataset, or data whose classes or image shape the model does not take.
    """
    from optkit.analysis.evaluation import EvalSettings, load_eval_set, score, torch_logits
    from optkit.passes.batchnorm.passes import recalibrate_batchnorm

    eval_set = load_eval_set(EvalSettings(data, samples=samples, batch_size=batch_size), model, shape,
                             split=SCORE_SPLIT)
    calibration = calibration_images(data, shape, calibration_samples, batch_size)
    reference = torch_logits(model, eval_set, batch_size)

    def scored(pruned: nn.Module) -> dict[str, Any]:
        if calibration:
            recalibrate_batchnorm(pruned, calibration)
        return score(torch_logits(pruned, eval_set, batch_size), eval_set, reference)

    return scored
