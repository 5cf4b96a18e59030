"""Image classifiers: one float image batch ``N,C,H,W`` in, logits out (optkit's original kind)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optkit.kinds.base import EvalData, EvalSet, ModelInputs, ModelKind, ScoreColumn, model_device

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_IMAGE_SIZE = 224


class ImageClassifier(ModelKind):
    """Any model taking one float tensor: an image batch ``N,C,H,W`` (or features ``N,F``).

    The fallback kind: a model no other kind recognises is treated as one.
    Its output tensors are compared as they are; the layers that write the
    model's outputs (the classifier) keep their width. Scored on labelled
    images: top-1 accuracy, and top-1 agreement and mean KL(original || this)
    of the softmax against the original model.
    """

    name = "image_classifier"
    description = "models taking one float tensor, such as an image batch N,C,H,W"
    priority = 100
    score_columns = (ScoreColumn("accuracy", "top-1 accuracy", ".2%"),
                     ScoreColumn("agreement", "agreement with original", ".2%"),
                     ScoreColumn("mean_kl", "mean KL", ".4f"))

    def matches(self, model: nn.Module) -> bool:
        return True

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        channels = input_channels(model)
        return (1, channels or 3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        return ModelInputs((random_images(model, shape, seed=seed),))

    def eval_set(self, model: nn.Module, shape: tuple[int, ...], spec: str, *, split: str, samples: int,
                 data: EvalData) -> EvalSet:
        images, labels, classes = data.labelled_images(spec, split, shape, samples)
        return EvalSet(spec, images, labels, classes, kind=self.name, split=split, unit="images")

    def score(self, outputs: torch.Tensor, eval_set: EvalSet, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """Accuracy on the labels and, given the original's logits, top-1 agreement and mean KL(original || this).

        Only the first ``len(outputs)`` labels and reference rows count (an ONNX file with a static batch
        size scores whole batches only).

        Returns:
            ``{"samples", "accuracy", "agreement", "mean_kl"}`` (the last two ``None`` without a reference).
        """
        import torch.nn.functional as F

        n = len(outputs)
        result: dict[str, Any] = {"samples": n, "accuracy": int((outputs.argmax(1) == eval_set.targets[:n]).sum()) / n,
                                  "agreement": None, "mean_kl": None}
        if reference is not None:
            reference = reference[:n]
            result["agreement"] = int((outputs.argmax(1) == reference.argmax(1)).sum()) / n
            result["mean_kl"] = float(F.kl_div(F.log_softmax(outputs, 1), F.log_softmax(reference, 1),
                                               reduction="batchmean", log_target=True))
        return result


def random_images(model: nn.Module, shape: tuple[int, ...], *, seed: int = 0):
    """A reproducible standard-normal float tensor of ``shape`` on the model's device."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(model_device(model))


def input_channels(model: nn.Module) -> int | None:
    """The input channels of the model's first 2-D convolution, or ``None`` without one."""
    from torch import nn

    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return first_conv.in_channels if first_conv is not None else None

