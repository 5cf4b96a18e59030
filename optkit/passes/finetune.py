"""The fine-tune stage as a pass: recover the accuracy pruning cost.

Trains with :func:`optkit.train.fit` on a dataset spec's ``train`` split and
keeps the weights that score best on its ``val`` split. With ``distill`` it
learns from the model as it was before the pipeline ran: a pipeline keeps a
deep copy of its input model and hands it to this pass as ``teacher``.

Samples are adapted to the model's input shape: a grayscale dataset is
repeated to 3 channels for a model that takes RGB (and RGB averaged for a
grayscale model), and images are resized to the input shape's height and width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.passes.base import NOT_IN_RECIPE, Pass, PassResult, check_choice, check_input_shape, check_range

if TYPE_CHECKING:
    from torch import nn

AMP_MODES = ("auto", "off", "bf16", "fp16")


@dataclass(frozen=True)
class FineTune(Pass):
    """Fine-tune with AdamW (cosine schedule, AMP, optional distillation from the unpruned model).

    Args:
        data: dataset spec, e.g. ``fashion-mnist``, ``imagefolder:DIR``, ``synthetic:512:3x32x32:10``.
        epochs: passes over the training split.
        batch_size: samples per step on each process.
        lr: peak learning rate.
        weight_decay: AdamW decay on weights (never on biases or norm parameters).
        warmup: fraction of the steps spent warming the learning rate up.
        grad_clip: maximum global gradient norm; 0 disables clipping.
        amp: autocast: ``auto`` (bf16 or fp16 on CUDA, off on CPU), ``off``, ``bf16`` or ``fp16``.
        distill: also learn from the model as it was before the pipeline ran.
        temperature: distillation softening temperature (> 0).
        alpha: weight of the distillation term, in [0, 1].
        seed: seed for the data order and any randomness in training.
        checkpoint_every: also checkpoint every this many steps (0: at epoch ends only).
        num_workers: data-loading processes, or ``auto`` to measure.
        input_shape: the model's input shape; samples are adapted to it.
        device: training device; CUDA when available if unset.
        checkpoint: file for resumable training checkpoints (none when unset). A run option,
            like ``resume`` and ``teacher``: not written to recipes.
        resume: continue from ``checkpoint`` when it exists.
        teacher: the model to distil from; filled in by the pipeline, never written to recipes.

    Works in place (the model returns on the device it came on).
    """

    name = "finetune"
    data: str = ""
    epochs: int = 2
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.05
    grad_clip: float = 1.0
    amp: str = "auto"
    distill: bool = False
    temperature: float = 4.0
    alpha: float = 0.5
    seed: int = 0
    checkpoint_every: int = 0
    num_workers: int | str = "auto"
    input_shape: tuple[int, ...] | None = None
    device: str | None = None
    checkpoint: str | None = field(default=None, metadata=NOT_IN_RECIPE)
    resume: bool = field(default=False, metadata=NOT_IN_RECIPE)
    teacher: Any = field(default=None, metadata=NOT_IN_RECIPE, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.data, str) or not self.data:
            raise ValueError("data must name a dataset, e.g. 'fashion-mnist', 'imagefolder:DIR' or 'synthetic:512'")
        for key in ("epochs", "batch_size"):
            _check_int(key, getattr(self, key), 1)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("seed", self.seed, 0)
        self._normalize("lr", check_range("lr", self.lr, 0.0, float("inf")))
        if self.lr == 0:
            raise ValueError("lr must be a number in (0, inf), got 0")
        self._normalize("weight_decay", check_range("weight_decay", self.weight_decay, 0.0, float("inf")))
        self._normalize("warmup", check_range("warmup", self.warmup, 0.0, 1.0))
        self._normalize("grad_clip", check_range("grad_clip", self.grad_clip, 0.0, float("inf")))
        check_choice("amp", self.amp, AMP_MODES)
        for key in ("distill", "resume"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        temperature = check_range("temperature", self.temperature, 0.0, float("inf"))
        if temperature == 0:
            raise ValueError("temperature must be a number in (0, inf), got 0")
        self._normalize("temperature", temperature)
        self._normalize("alpha", check_range("alpha", self.alpha, 0.0, 1.0, high_inclusive=True))
        if self.num_workers != "auto":
            _check_int("num_workers", self.num_workers, 0, also="or 'auto'")
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            raise ValueError(f"checkpoint must be a file path, got {self.checkpoint!r}")
        self._normalize("input_shape", check_input_shape(self.input_shape))
        if self.teacher is not None and not _is_module(self.teacher):
            raise ValueError("teacher must be an nn.Module (it is filled in by the pipeline for distill = true)")

    @property
    def wants_teacher(self) -> bool:
        """Whether a pipeline should hand this pass a copy of its input model as ``teacher``."""
        return self.distill and self.teacher is None

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.data import dataset_info, load_dataset
        from optkit.errors import DataError
        from optkit.metrics import model_device
        from optkit.train import TrainConfig, fit

        if self.distill and self.teacher is None:
            raise DataError("distill needs the model before pruning: run the pass in a Pipeline, "
                            "or give teacher=MODEL (optkit finetune --teacher SPEC)")
        info = dataset_info(self.data)
        shape = self.input_shape or (1, info.channels, *info.image_size)
        _check_classes(model, shape, info.num_classes, self.data)
        # The held-out val images stay the same whatever the training seed.
        train_set = _adapted(load_dataset(self.data, "train"), shape)
        val_set = _adapted(load_dataset(self.data, "val"), shape)
        config = TrainConfig(
            epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, weight_decay=self.weight_decay,
            warmup=self.warmup, grad_clip=self.grad_clip, amp=self.amp, alpha=self.alpha,
            temperature=self.temperature, seed=self.seed, checkpoint=self.checkpoint,
            checkpoint_every=self.checkpoint_every, resume=self.resume, device=self.device,
            num_workers=self.num_workers)
        home = model_device(model)
        result = fit(model, train_set, val_set, config, teacher=self.teacher if self.distill else None)
        result.model.to(home)
        if self.teacher is not None:
            self.teacher.to(home)
        details = {"data": self.data, "epochs": self.epochs, "distill": self.distill,
                   "best_epoch": result.best_epoch, "val_accuracy": result.best_accuracy,
                   "history": result.history}
        if result.skipped_steps:
            details["skipped_fp16_steps"] = result.skipped_steps
        return PassResult(result.model, details)


def _check_int(name: str, value: Any, low: int, also: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' ' + also if also else ''}, got {value!r}")


def _is_module(value: Any) -> bool:
    from torch import nn

    return isinstance(value, nn.Module)


def _check_classes(model: nn.Module, shape: tuple[int, ...], num_classes: int, data: str) -> None:
    import torch

    from optkit.errors import DataError
    from optkit.metrics import example_input

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(example_input(model, (2, *shape[1:])))
    except Exception as e:
        raise DataError(f"the model does not run on {data} samples shaped {tuple(shape[1:])} ({e}); "
                        "set --input-shape to what the model expects") from e
    finally:
        model.train(was_training)
    if outputs.dim() != 2 or outputs.shape[1] < num_classes:
        raise DataError(f"the model gives {tuple(outputs.shape[1:])} outputs per sample but {data} has "
                        f"{num_classes} classes; build it with --num-classes {num_classes}")


class _AdaptedInputs:
    """A dataset view whose images are reshaped to the model's channels and size, a batch at a time."""

    def __init__(self, dataset, channels: int, size: tuple[int, int]):
        self.dataset, self.channels, self.size = dataset, channels, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        import torch

        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__(list(indices))
        else:
            samples = [self.dataset[i] for i in indices]
        images = _adapt(torch.stack([image for image, _ in samples]), self.channels, self.size)
        return list(zip(images.unbind(0), [label for _, label in samples]))


def _adapt(images, channels: int, size: tuple[int, int]):
    import torch.nn.functional as F

    from optkit.errors import DataError

    if images.shape[1] != channels:
        if images.shape[1] == 1:
            images = images.expand(-1, channels, -1, -1)
        elif channels == 1:
            images = images.mean(dim=1, keepdim=True)
        else:
            raise DataError(f"the data has {images.shape[1]}-channel images but the model takes {channels} "
                            "channels; set --input-shape to the model's input")
    if tuple(images.shape[-2:]) != tuple(size):
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
    return images.contiguous()


def _adapted(dataset, shape: tuple[int, ...]):
    if len(shape) != 4:
        return dataset
    image, _ = dataset[0]
    if image.shape[0] == shape[1] and tuple(image.shape[-2:]) == tuple(shape[2:]):
        return dataset
    return _AdaptedInputs(dataset, shape[1], tuple(shape[2:]))
