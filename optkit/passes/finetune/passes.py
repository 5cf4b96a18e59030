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
    data: str = setting(dataset=True, help="Dataset spec to train on: fashion-mnist[:DIR], imagefolder:DIR, mnist:DIR, "
                        "cifar10:DIR, synthetic:N[:CxHxW[:K]]; text[:FILE|DIR] trains a causal language model on the next "
                        "token.", flag="finetune", enables=True, metavar="SPEC",
                        example="synthetic:64:1x28x28:10")
    epochs: int = setting(2, help="Passes over the training split.", low=1, flag="epochs")
    batch_size: int = setting(128, help="Samples per step on each process.", low=1, flag="batch-size")
    lr: float = setting(3e-3, help="Peak AdamW learning rate (cosine schedule after warmup); 3e-3 kept the most "
                        "accuracy after pruning in benchmarks/results/defaults.md.", low=0, low_open=True,
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
    sharding: str = setting("auto", help="How training spreads over torchrun's processes: ddp (a whole copy of the "
                            "model on every device), fsdp (each block's weights, gradients and AdamW state "
                            "sharded over the devices, blocks recomputed in backward, the teacher sharded too), "
                            "or auto (fsdp when 4x the model's parameter bytes plus the teacher's exceed half of "
                            "one GPU's memory, else ddp; always ddp on CPU). No effect in one process.",
                            choices=("auto", "ddp", "fsdp"), flag="sharding")
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
        from optkit.core.errors import DataError
        from optkit.data import dataset_info, load_dataset
        from optkit.data.adapt import adapted, check_fits
        from optkit.data.specs import is_text

        if self.distill and self.teacher is None:
            raise DataError("distill needs the model before pruning: run the pass in a Pipeline, "
                            "or give teacher=MODEL (optkit finetune --teacher SPEC)")
        if is_text(self.data):
            return self._train_on_text(model)
        info = dataset_info(self.data)
        shape = self.input_shape or (1, info.channels, *info.image_size)
        check_fits(model, shape, info.num_classes, self.data)
        # The held-out val images stay the same whatever the training seed.
        train_set = adapted(load_dataset(self.data, "train"), shape)
        val_set = adapted(load_dataset(self.data, "val"), shape)
        warning = _chance_warning(model, val_set, info.num_classes, self.data)
        return self._fit(model, train_set, val_set, [warning])

    def _train_on_text(self, model: nn.Module) -> PassResult:
        """A causal language model learns the next token of text blocks as long as its example inputs (the
        whole train split, or ``max_train_samples`` blocks of it); the first :data:`TEXT_VAL_BLOCKS` blocks of
        ``val`` pick the best epoch by next-token top-1."""
        from optkit.analysis.evaluation import DataReaders
        from optkit.data.text import next_token_dataset

        seq_len = self.input_shape[-1] if self.input_shape and len(self.input_shape) == 2 else TEXT_SEQ_LEN
        config = getattr(model, "config", None)
        readers = DataReaders(model)

        def blocks(split: str, count: int):
            return next_token_dataset(*readers.token_blocks(
                self.data, split, seq_len, count, vocab_size=getattr(config, "vocab_size", None),
                max_positions=getattr(config, "max_position_embeddings", None)))

        return self._fit(model, blocks("train", self.max_train_samples or 10 ** 9), blocks("val", TEXT_VAL_BLOCKS), [])

    def _fit(self, model: nn.Module, train_set, val_set, notes: list[str | None]) -> PassResult:
        from optkit.kinds import model_device
        from optkit.passes.finetune.loop import fit

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
        notes = [note for note in (result.resumed, *notes) if note]
        if notes:
            details["notes"] = notes
        return PassResult(result.model, details)


#: Tokens per training block when the pipeline gives no sequence length.
TEXT_SEQ_LEN = 128
#: Validation blocks scored after each epoch of training on text.
TEXT_VAL_BLOCKS = 128


def _is_module(value: Any) -> bool:
    from torch import nn

    return isinstance(value, nn.Module)


#: Validation images scored before training to catch data the model was not trained on (wrong normalization).
CHANCE_CHECK_SAMPLES = 512


def _chance_warning(model: nn.Module, val_set, num_classes: int, spec: str) -> str | None:
    """Say so, before training, when the model scores near chance on the data (a mismatch, or untrained weights):
    a warning, or a plain note for a model whose weights are random by design (``torchvision:NAME``)."""
    import logging

    from optkit.analysis.accuracy import chance_warning, top1_accuracy
    from optkit.io.weights import random_weights

    accuracy = top1_accuracy(model, val_set, max_samples=CHANCE_CHECK_SAMPLES)
    random = random_weights(model)
    warning = chance_warning(accuracy, num_classes, spec, what="the model before fine-tuning", random_weights=random)
    if warning and not random:
        warning += " (expected only when its weights are untrained)"
        logging.getLogger(__name__).warning("warning: %s", warning)
    return warning
