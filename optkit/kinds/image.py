"""Image classifiers: one float image batch ``N,C,H,W`` in, logits out (optkit's original kind).

The default image size is the one the model states: a Hugging Face config's
``image_size`` (and ``num_channels``), a timm model's ``pretrained_cfg``, or the
crop size of torchvision's weights for its architecture; 224 otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optkit.kinds.base import EvalData, EvalSet, ModelInputs, ModelKind, ScoreColumn, is_hf_pretrained, model_device
from optkit.kinds.registry import register_kind

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_IMAGE_SIZE = 224


@register_kind
class ImageClassifier(ModelKind):
    """Any model taking one float tensor: an image batch ``N,C,H,W`` (or features ``N,F``).

    The fallback kind: a model no other kind recognises is treated as one.
    Its output tensors are compared as they are; the layers that write the
    model's outputs (the classifier) keep their width. The exported graph's
    input is ``input``, or a Hugging Face model's own input name (``pixel_values``).
    Scored on labelled
    images: top-1 accuracy, and top-1 agreement and mean KL(original || this)
    of the softmax against the original model.
    """

    name = "image_classifier"
    description = "models taking one float tensor, such as an image batch N,C,H,W"
    priority = 100
    throughput_unit = "images"
    score_columns = (ScoreColumn("accuracy", "top-1 accuracy", ".2%"),
                     ScoreColumn("agreement", "agreement with original", ".2%"),
                     ScoreColumn("mean_kl", "mean KL", ".4f"))

    def matches(self, model: nn.Module) -> bool:
        return True

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        """One image of the channels and size the model states (see :func:`stated_image_shape`), else of its first
        convolution's input channels (3 without one) at 224×224."""
        channels, size = stated_image_shape(model)
        return (1, channels or input_channels(model) or 3, *(size or (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)))

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        names = (model.main_input_name,) if is_hf_pretrained(model) else ("input",)
        return ModelInputs((random_images(model, shape, seed=seed),), names=names)

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
            # a class the original ties first with others agrees too (see optkit.passes.quantize.verify.agreement)
            chosen = reference.gather(1, outputs.argmax(1, keepdim=True)).squeeze(1)
            result["agreement"] = int((chosen >= reference.max(1).values).sum()) / n
            result["mean_kl"] = float(F.kl_div(F.log_softmax(outputs, 1), F.log_softmax(reference, 1),
                                               reduction="batchmean", log_target=True))
        return result


def random_images(model: nn.Module, shape: tuple[int, ...], *, seed: int = 0):
    """A reproducible standard-normal float tensor of ``shape`` on the model's device."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(model_device(model))


def stated_image_shape(model: nn.Module) -> tuple[int | None, tuple[int, int] | None]:
    """The input channels and ``(height, width)`` the model itself states (``None`` for what it does not).

    In order: a Hugging Face config's ``num_channels`` and ``image_size``; a timm model's
    ``pretrained_cfg`` (or ``default_cfg``) ``input_size`` (its size only: the channels are the
    first convolution's); the crop size every torchvision weights of its architecture's module
    share (Inception v3: 299). Nothing is downloaded.
    """
    if is_hf_pretrained(model):
        channels, size = getattr(model.config, "num_channels", None), getattr(model.config, "image_size", None)
        return (channels if isinstance(channels, int) else None), _height_width(size)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(cfg, dict) and isinstance(cfg.get("input_size"), (tuple, list)) and len(cfg["input_size"]) == 3:
        return None, _height_width(tuple(cfg["input_size"][1:]))
    return None, _height_width(_torchvision_crop(model))


def _height_width(size: object) -> tuple[int, int] | None:
    if isinstance(size, int) and size > 0:
        return (size, size)
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size):
        return (size[0], size[1])
    return None


def _torchvision_crop(model: nn.Module) -> int | None:
    """The crop size of torchvision's weights for the model's class: the one every weights enum of its module (or a
    base class's) gives, so an architecture whose variants were trained at several sizes gives none."""
    import sys

    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torchvision.models."):
            continue
        from torchvision.models import WeightsEnum

        enums = [value for value in vars(sys.modules[cls.__module__]).values()
                 if isinstance(value, type) and issubclass(value, WeightsEnum) and value is not WeightsEnum]
        crops = {getattr(weights.transforms, "keywords", {}).get("crop_size") for enum in enums for weights in enum}
        if crops:
            return crops.pop() if len(crops) == 1 else None
    return None


def input_channels(model: nn.Module) -> int | None:
    """The input channels of the model's first 2-D convolution, or ``None`` without one."""
    from torch import nn

    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return first_conv.in_channels if first_conv is not None else None

