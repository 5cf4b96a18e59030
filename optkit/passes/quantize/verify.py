"""Checks that fit quantization: top-1 agreement with the FP32 model, relative output error, accuracy.

INT8 outputs differ from FP32 ones by design, so an elementwise 1e-3 check
would refuse every good model; what matters is that the INT8 model makes the
same decisions on real inputs.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from optkit.passes.quantize.calibration import Batches, load_batches

#: A check that misses by less than this many standard errors (of its image count) is decided again on more images.
NOISE_SE = 2.0
#: How many times the images a near miss is checked again on.
SECOND_LOOK_FACTOR = 4


@dataclass
class Agreement:
    """INT8 against FP32 on the same inputs.

    Attributes:
        samples: inputs compared.
        agreement: fraction of inputs whose top-1 class is the same.
        relative_error: ``||int8 - fp32|| / ||fp32||`` over all outputs.
        accuracy_fp32, accuracy_int8: top-1 accuracy when the inputs have labels that fit the outputs, else ``None``.
    """

    samples: int
    agreement: float
    relative_error: float
    accuracy_fp32: float | None = None
    accuracy_int8: float | None = None

    @property
    def accuracy_drop(self) -> float | None:
        """FP32 accuracy minus INT8 accuracy (``None`` without labels)."""
        if self.accuracy_fp32 is None or self.accuracy_int8 is None:
            return None
        return self.accuracy_fp32 - self.accuracy_int8

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy_drop": self.accuracy_drop}


def outputs(path: str | os.PathLike, batches: Batches, *, threads: int = 1) -> np.ndarray:
    """The first output of an ONNX model on every batch, stacked, flattened to ``samples × values`` (a batch is
    the model's one input, or a feed of every input by name)."""
    from optkit.runtime.onnxrt import onnx_session

    s = onnx_session(path, threads, spinning=False)
    name = s.get_inputs()[0].name
    feeds = [x if isinstance(x, dict) else {name: x} for x in batches.inputs]
    return np.concatenate([s.run(None, feed)[0].reshape(len(next(iter(feed.values()))), -1) for feed in feeds])


def agreement(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray | None = None) -> Agreement:
    """Compare FP32 and INT8 outputs (``samples × classes``).

    An output agrees when its top-1 class is one the FP32 output ranks first: where FP32 ties several classes
    exactly (a model whose features are all zero for an image gives its bias alone), any of them agrees, since
    which one ``argmax`` returns says nothing about the model. Accuracy is given only when every label indexes an
    output column.
    """
    top_fp32, top_int8 = fp32.argmax(axis=1), int8.argmax(axis=1)
    agrees = fp32[np.arange(len(fp32)), top_int8] >= fp32.max(axis=1)
    norm = float(np.linalg.norm(fp32))
    diff = float(np.linalg.norm(int8.astype(np.float64) - fp32))
    result = Agreement(len(fp32), float(np.mean(agrees)), diff / norm if norm > 0 else diff)
    if labels is not None and len(labels) == len(fp32) and labels.size and labels.max() < fp32.shape[1]:
        result.accuracy_fp32 = float(np.mean(top_fp32 == labels))
        result.accuracy_int8 = float(np.mean(top_int8 == labels))
    return result


def misses(result: Agreement, min_agreement: float, max_accuracy_drop: float) -> list[str]:
    """What the INT8 model missed, in words (empty when it passes)."""
    found = []
    if result.agreement < min_agreement:
        found.append(f"top-1 agreement {result.agreement:.2%} < {min_agreement:.2%}")
    drop = result.accuracy_drop
    if drop is not None and drop > max_accuracy_drop:
        found.append(f"accuracy {result.accuracy_int8:.2%} vs {result.accuracy_fp32:.2%} FP32 "
                     f"(drop {100 * drop:.2f} points > {100 * max_accuracy_drop:.2f})")
    return found


def within_noise(result: Agreement, min_agreement: float, max_accuracy_drop: float) -> bool:
    """Whether a result that misses a threshold could pass it on more images: its agreement at most
    :data:`NOISE_SE` standard errors below ``min_agreement`` (binomial, at the threshold), and its accuracy drop at
    most that many standard errors of a paired difference above ``max_accuracy_drop`` (only images the two models
    classify differently move it, so its variance is at most their fraction over the image count).

    On 256 images at a 99 % threshold, 98.0 % agreement (5 images differ) is within noise, 97.7 % (6 images) is not.
    """
    n = max(result.samples, 1)
    if result.agreement < min_agreement - NOISE_SE * math.sqrt(min_agreement * (1 - min_agreement) / n):
        return False
    drop = result.accuracy_drop
    return drop is None or drop <= max_accuracy_drop + NOISE_SE * math.sqrt(max(1 - result.agreement, 1 / n) / n)


def decided(result: Agreement, min_agreement: float, max_accuracy_drop: float,
            wider: Callable[[], Agreement | None] | None = None) -> tuple[Agreement, list[str]]:
    """The check's verdict ``(result, misses)``: ``result``'s, or, when it misses within sampling noise
    (:func:`within_noise`), that of ``wider()`` — the same check on more images, which decides alone (``None``, or no
    more images than ``result``: ``result`` stands)."""
    missed = misses(result, min_agreement, max_accuracy_drop)
    if missed and wider is not None and within_noise(result, min_agreement, max_accuracy_drop):
        more = wider()
        if more is not None and more.samples > result.samples:
            return more, misses(more, min_agreement, max_accuracy_drop)
    return result, missed


def wider_batches(spec: str, shape: tuple[int, ...], batch: int, eval_samples: int,
                  seed: int) -> Callable[[], Batches]:
    """A loader of :data:`SECOND_LOOK_FACTOR` times ``eval_samples`` images of ``spec``'s ``val`` split, the checking
    images (drawn with the same ``seed``) first: the second look's images."""
    return functools.partial(load_batches, spec, "val", shape, batch_size=batch,
                             samples=SECOND_LOOK_FACTOR * eval_samples, seed=seed)


def checked_on(checking: Batches, samples: int) -> str:
    """Where a verdict came from, in words: ``checking``'s source, and the image counts when a second look on
    ``samples`` images decided it."""
    if samples == checking.samples:
        return checking.source
    return f"{checking.source}, {samples} images after a near miss on {checking.samples}"
