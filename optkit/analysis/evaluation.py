"""Evaluation at every stage: top-1 accuracy on a test split, and fidelity to the original model.

Accuracy needs labels; fidelity does not: top-1 agreement with the original
model's predictions and the mean KL divergence from its softmax, on the same
inputs. The images are read once (the first ``samples`` of the spec's
``test`` split, adapted to the model's input like the fine-tune data), so
every stage, PyTorch or ONNX Runtime, is scored on exactly the same tensors.
The fine-tune pass selects its best epoch on the ``val`` split, which is
held out of the training files and never overlaps ``test``.

Importing this module needs no torch (the CLI reads :class:`EvalSettings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.settings import setting, validate_fields

if TYPE_CHECKING:
    import torch
    from torch import nn

EVAL_SPLIT = "test"


@dataclass(frozen=True)
class EvalSettings:
    """Which data scores the model at each stage (accuracy and fidelity to the original)."""

    data: str = setting(help="Dataset spec whose test split scores the original and the result after each stage "
                        "(accuracy, and agreement / KL with the original).", flag="eval", metavar="SPEC",
                        dataset=True, example="synthetic:64:3x32x32:10")
    samples: int = setting(2000, help="Score the first this many test images.", low=1, flag="eval-samples")
    batch_size: int = setting(128, help="Images per forward pass while scoring.", low=1, flag="eval-batch-size")

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass
class EvalSet:
    """The scoring images, read once and adapted to the model's input.

    Attributes:
        spec: the dataset spec.
        images: ``N×C×H×W`` float tensor, normalized as the spec says.
        labels: ``N`` class indices.
        num_classes: classes in the dataset.
    """

    spec: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int


def load_eval_set(settings: EvalSettings, model: nn.Module, input_shape: tuple[int, ...], *,
                  split: str = EVAL_SPLIT) -> EvalSet:
    """Read the scoring images of ``split`` and check that the model fits them (one forward pass).

    Raises:
        DataError: for a missing dataset, or data whose classes or image shape the model does not take.
    """
    import torch

    from optkit.data import dataset_info, load_dataset
    from optkit.data.adapt import adapted, check_fits

    info = dataset_info(settings.data)
    check_fits(model, input_shape, info.num_classes, settings.data)
    dataset = adapted(load_dataset(settings.data, split, augment=False), input_shape)
    count = min(settings.samples, len(dataset))
    samples = [dataset[i] for i in range(count)]
    images = torch.stack([image for image, _ in samples])
    labels = torch.tensor([int(label) for _, label in samples])
    return EvalSet(settings.data, images, labels, info.num_classes)


def torch_logits(model: nn.Module, eval_set: EvalSet, batch_size: int = 128) -> torch.Tensor:
    """The model's logits on the scoring images (eval mode, no gradients, on the model's device), on CPU."""
    import torch

    from optkit.analysis.metrics import eval_mode, model_device

    device = model_device(model)
    outputs = []
    with eval_mode(model), torch.no_grad():
        for start in range(0, len(eval_set.images), batch_size):
            outputs.append(model(eval_set.images[start:start + batch_size].to(device)).float().cpu())
    return torch.cat(outputs)


def onnx_logits(path: str | os.PathLike, eval_set: EvalSet, batch_size: int = 128) -> torch.Tensor:
    """An ONNX file's logits on the scoring images, with ONNX Runtime on the CPU."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    static_batch = session.get_inputs()[0].shape[0]
    step = static_batch if isinstance(static_batch, int) else batch_size
    outputs = []
    for start in range(0, len(eval_set.images), step):
        chunk = eval_set.images[start:start + step].numpy()
        if isinstance(static_batch, int) and len(chunk) < static_batch:
            break
        outputs.append(torch.from_numpy(session.run(None, {name: chunk})[0]).float())
    return torch.cat(outputs)


def score(logits: torch.Tensor, eval_set: EvalSet, reference: torch.Tensor | None = None) -> dict[str, Any]:
    """Accuracy on the labels and, given the original's logits, top-1 agreement and mean KL(original || this).

    Returns:
        ``{"samples", "accuracy", "agreement", "mean_kl"}`` (the last two ``None`` without a reference).
    """
    import torch.nn.functional as F

    n = len(logits)
    labels = eval_set.labels[:n]
    result: dict[str, Any] = {"samples": n, "accuracy": int((logits.argmax(1) == labels).sum()) / n,
                              "agreement": None, "mean_kl": None}
    if reference is not None:
        reference = reference[:n]
        result["agreement"] = int((logits.argmax(1) == reference.argmax(1)).sum()) / n
        result["mean_kl"] = float(F.kl_div(F.log_softmax(logits, 1), F.log_softmax(reference, 1),
                                           reduction="batchmean", log_target=True))
    return result
