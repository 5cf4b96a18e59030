"""The fine-tune stage as a pass: recover the accuracy pruning cost.

Trains with :func:`optkit.passes.finetune.loop.fit` on a dataset spec's ``train`` split and
keeps the weights that score best on its ``val`` split. With ``distill`` it
learns from the model as it was before the pipeline ran: a pipeline keeps a
deep copy of its input model and hands it to this pass as ``teacher``.

Samples are adapted to the model's input shape: a grayscale dataset is
repeated to 3 channels for a model that takes RGB (and RGB averaged for a
grayscale model), and images are resized to the input shape's height and width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.contract import Pass, PassResult, Stage
from optkit.core.registry import register_pass
from optkit.core.settings import setting, shared_setting, workers_setting
from optkit.passes.precision.modes import AMP_CHOICES

if TYPE_CHECKING:
    from torch import nn

@register_pass
@dataclass(frozen=True)
class FineTune(Pass):
    """Fine-tune with AdamW (cosine schedule, AMP, optional distillation from the unpruned model).

    These settings are the training loop's only declaration: the CLI's training
    options and :func:`optkit.passes.finetune.loop.fit` read them from here.
    ``checkpoint``, ``resume`` and ``teacher`` are run options, never written to
    recipes. Works in place (the model returns on the device it came on).
    """

    name = "finetune"
    stage = Stage.TRAIN
    data: str = setting(help="Dataset spec to train on: fashion-mnist[:DIR], imagefolder:DIR, mnist:DIR, "
                        "cifar10:DIR, synthetic:N[:CxHxW[:K]].", flag="finetune", enables=True, metavar="SPEC",
                        example="synthetic:64:1x28x28:10")
    epochs: int = setting(2, help="Passes over the training split.", low=1, flag="epochs")
    batch_size: int = setting(128, help="Samples per step on each process.", low=1, flag="batch-size")
    lr: float = setting(1e-3, help="Peak AdamW learning rate (cosine schedule after warmup).", low=0, low_open=True,
                        flag="lr")
    weight_decay: float = setting(0.05, help="AdamW weight decay (never on biases and norm parameters).", low=0,
                                  flag="weight-decay")
    warmup: float = setting(0.05, help="Fraction of the steps spent warming the learning rate up.", low=0, high=1,
                            high_open=True, flag="warmup")
    grad_clip: float = setting(1.0, help="Clip the global gradient norm to this (0 disables clipping).", low=0,
                               flag="grad-clip")
    amp: str = setting("auto", help="Autocast while training: auto (bf16 or fp16 on CUDA, off on CPU and MPS), off, "
                       "bf16 or fp16.", choices=AMP_CHOICES, flag="train-amp")
    distill: bool = setting(False, help="Also learn from the model before pruning (knowledge distillation).",
                            flag="distill")
    temperature: float = setting(4.0, help="Distillation softening temperature.", low=0, low_open=True,
                                 flag="temperature")
    alpha: float = setting(0.5, help="Weight of the distillation term (the label loss gets 1 - alpha).", low=0,
                           high=1, flag="alpha")
    seed: int = setting(0, help="Seed for the data order and training randomness.", low=0, flag="seed")
    max_train_samples: int | None = setting(None, help="Train on at most this many samples of the train split "
                                            "(a fixed subset drawn with the seed), for a quick try.", low=1,
                                            flag="max-train-samples", metavar="N")
    max_steps: int | None = setting(None, help="Stop after this many optimizer steps in all (the schedule is "
                                    "sized to the steps run), for a quick try.", low=1, flag="max-steps",
                                    metavar="N")
    checkpoint_every: int = setting(200, help="Checkpoint every this many steps as well as at each epoch end "
                                    "(0: epoch ends only).", low=0, flag="checkpoint-every")
    num_workers: int | str = workers_setting("auto")
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")
    device: str | None = shared_setting("device", help="Training device (auto: CUDA, then MPS, then CPU).")
    checkpoint: str | None = setting(None, help="File for resumable training checkpoints (none when unset).",
                                     recipe=False)
    resume: bool = setting(False, help="Continue from the checkpoint after an interruption.", recipe=False,
                           flag="resume")
    teacher: Any = setting(None, help="The model to distil from; filled in by the pipeline.", recipe=False,
                           compare=False, repr=False)

    def check(self) -> None:
        if self.teacher is not None and not _is_module(self.teacher):
            raise ValueError("teacher must be an nn.Module (it is filled in by the pipeline for distill = true)")

    @property
    def wants_teacher(self) -> bool:
        """Whether a pipeline should hand this pass a copy of its input model as ``teacher``."""
        return self.distill and self.teacher is None

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.data import dataset_info, load_dataset
        from optkit.core.errors import DataError
        from optkit.analysis.metrics import model_device
        from optkit.passes.finetune.loop import fit

        if self.distill and self.teacher is None:
            raise DataError("distill needs the model before pruning: run the pass in a Pipeline, "
                            "or give teacher=MODEL (optkit finetune --teacher SPEC)")
        info = dataset_info(self.data)
        shape = self.input_shape or (1, info.channels, *info.image_size)
        _check_classes(model, shape, info.num_classes, self.data)
        # The held-out val images stay the same whatever the training seed.
        train_set = _adapted(load_dataset(self.data, "train"), shape)
        val_set = _adapted(load_dataset(self.data, "val"), shape)
        home = model_device(model)
        result = fit(model, train_set, val_set, self, teacher=self.teacher if self.distill else None)
        result.model.to(home)
        if self.teacher is not None:
            self.teacher.to(home)
        details = {"data": self.data, "epochs": self.epochs, "distill": self.distill,
                   "best_epoch": result.best_epoch, "val_accuracy": result.best_accuracy,
                   "history": result.history}
        if result.skipped_steps:
            details["skipped_fp16_steps"] = result.skipped_steps
        return PassResult(result.model, details)


def _is_module(value: Any) -> bool:
    from torch import nn

    return isinstance(value, nn.Module)


def _check_classes(model: nn.Module, shape: tuple[int, ...], num_classes: int, data: str) -> None:
    import torch

    from optkit.core.errors import DataError
    from optkit.analysis.metrics import example_input

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

    from optkit.core.errors import DataError

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
