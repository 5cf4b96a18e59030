"""Evaluation at every stage: the model kind's scores on a test split, and fidelity to the original model.

The model's kind decides how it is scored (:meth:`optkit.kinds.ModelKind.score`):
an image classifier gets top-1 accuracy on labelled images, a causal language
model perplexity and next-token top-1 accuracy on text (``text[:FILE|DIR]``,
tokenized by the model's own tokenizer); both get top-1 agreement with the
original model's predictions and the mean KL divergence from its softmax on the
same inputs, which need no labels. A segmentation model gets mIoU and pixel
accuracy on a segmentation folder (``segfolder:DIR``) and the share of pixels it
predicts as the original does; a detector mAP@0.5 and mAP@0.5:0.95 on a COCO
folder (``coco:DIR``) and the mAP@0.5 of its detections against the original's
confident ones. The samples are read once (the first
``samples`` of the spec's ``test`` split, shaped as the model takes them), so
every stage, PyTorch or ONNX Runtime, is scored on exactly the same tensors.
The fine-tune pass selects its best epoch on the ``val`` split, which never
overlaps ``test``.

Importing this module needs no torch (the CLI reads :class:`EvalSettings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.settings import Settings, setting
from optkit.kinds.base import EvalSet

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["EVAL_SPLIT", "DataReaders", "EvalSet", "EvalSettings", "load_eval_set", "onnx_logits", "reference",
           "score", "score_columns", "score_model", "tokenizer_folders", "torch_logits"]

EVAL_SPLIT = "test"


@dataclass(frozen=True)
class EvalSettings(Settings):
    """Which data scores the model at each stage (accuracy and fidelity to the original)."""

    data: str = setting(help="Dataset spec whose test split scores the original and the result after each stage, "
                        "and their agreement with the original: labelled images for a classifier, text[:FILE|DIR] "
                        "for a causal LM, segfolder:DIR for segmentation, coco:DIR for detection.", flag="eval",
                        metavar="SPEC", dataset=True, example="synthetic:64:3x32x32:10")
    samples: int = setting(2000, help="Score the first this many test images.", low=1, flag="eval-samples")
    batch_size: int = setting(128, help="Images per forward pass while scoring.", low=1, flag="eval-batch-size")


class DataReaders:
    """The data layer's readers for one model (the :class:`optkit.kinds.base.EvalData` a kind reads with).

    Args:
        model: the model to be scored (run once to check that it takes the images).
        source: the model spec it was loaded from; its folder is where a ``text`` spec
            looks for the tokenizer (see :func:`tokenizer_folders`).
    """

    def __init__(self, model: nn.Module, source: str | os.PathLike | None = None):
        self.model = model
        self.source = source

    def labelled_images(self, spec: str, split: str, shape: tuple[int, ...],
                        samples: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        import torch

        from optkit.data import dataset_info, load_dataset
        from optkit.data.adapt import adapted, check_fits

        info = dataset_info(spec)
        check_fits(self.model, shape, info.num_classes, spec)
        dataset = adapted(load_dataset(spec, split, augment=False), shape)
        count = min(samples, len(dataset))
        pairs = [dataset[i] for i in range(count)]
        labels = torch.tensor([int(label) for _, label in pairs])
        return torch.stack([image for image, _ in pairs]), labels, info.num_classes

    def token_blocks(self, spec: str, split: str, seq_len: int, samples: int, *, vocab_size: int | None,
                     max_positions: int | None, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from optkit.core.errors import DataError
        from optkit.data.specs import is_text, parse_spec
        from optkit.data.text import find_tokenizer, token_blocks

        if not is_text(spec):
            raise DataError(f"{spec} holds images, but a language model is scored on text: give --eval text "
                            "(the Python documentation) or text:FILE|DIR")
        folder = find_tokenizer(tokenizer_folders(self.model, self.source))
        blocks = token_blocks(parse_spec(spec).arg, split, folder, seq_len, vocab_size=vocab_size,
                              max_positions=max_positions, max_blocks=samples, spread=spread)
        return blocks.input_ids, blocks.attention_mask

    def segmentation_masks(self, spec: str, split: str, shape: tuple[int, ...],
                           samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        from optkit.data.segfolder import read_segfolder

        return read_segfolder(spec, split, shape, samples)

    def detection_images(self, spec: str, split: str, shape: tuple[int, ...],
                         samples: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        from optkit.data.coco import read_coco

        return read_coco(spec, split, shape, samples)


def tokenizer_folders(model: nn.Module, source: str | os.PathLike | None) -> list[Path]:
    """Where a model's tokenizer may be, in order: the folder it was loaded from (``hf:DIR`` or a
    ``save_pretrained`` folder), the folder of the file it was loaded from (optkit writes the tokenizer
    beside ``model.pt``), and the folder its config was read from (``config.name_or_path``)."""
    from optkit.io.hf import hf_folder

    folders: list[Path] = []
    if source is not None:
        folder = hf_folder(str(source))
        path = Path(source)
        folders += [folder] if folder is not None else [path.parent] if path.is_file() else []
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    if name:
        folders.append(Path(name))
    return folders


def load_eval_set(settings: EvalSettings, model: nn.Module, input_shape: tuple[int, ...], *,
                  split: str = EVAL_SPLIT, source: str | os.PathLike | None = None) -> EvalSet:
    """Read the first ``settings.samples`` scoring samples of ``split``, as the model's kind reads them.

    Args:
        settings: the dataset spec, sample count and batch size.
        model: the model before any pass.
        input_shape: the pipeline's input shape (an image shape, or ``N,L`` for token models).
        split: ``test`` for reports.
        source: the model spec it was loaded from (where a language model's tokenizer is found).

    Returns:
        the :class:`EvalSet`.

    Raises:
        DataError: for a missing dataset, or data the model cannot be scored on (classes or image
            shape it does not take; text without the model's tokenizer, or that does not fit its
            vocabulary or positions).
        OptkitError: for a kind that has no scoring.
    """
    from optkit.kinds import kind_of

    return kind_of(model).eval_set(model, tuple(input_shape), settings.data, split=split, samples=settings.samples,
                                   data=DataReaders(model, source))


def torch_logits(model: nn.Module, eval_set: EvalSet, batch_size: int = 128) -> Any:
    """A PyTorch model's outputs on the scoring samples (eval mode, no gradients, on the model's device), as
    its kind scores them: logits on the CPU for a classifier, logits read a batch at a time for a language model."""
    from optkit.kinds import get_kind

    return get_kind(eval_set.kind).eval_outputs(model, eval_set, batch_size)


def onnx_logits(path: str | os.PathLike, eval_set: EvalSet, batch_size: int = 128) -> Any:
    """An ONNX file's outputs on the scoring samples, with ONNX Runtime on the CPU (see :func:`torch_logits`)."""
    from optkit.kinds import get_kind

    return get_kind(eval_set.kind).eval_outputs(os.fspath(path), eval_set, batch_size)


def reference(model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int = 128) -> Any:
    """The original's outputs on the scoring samples as later stages are compared with them, computed now and kept
    compactly (a language model's top tokens per position, never every logit; see
    :meth:`optkit.kinds.ModelKind.reference`); :func:`score` of it gives the original's figures."""
    from optkit.kinds import get_kind

    return get_kind(eval_set.kind).reference(model, eval_set, batch_size)


def score_model(model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int = 128,
                reference: Any = None) -> dict[str, Any]:
    """:func:`score` of a PyTorch model or an ONNX file, run now a batch at a time (nothing of it is kept)."""
    from optkit.kinds import get_kind

    return get_kind(eval_set.kind).score_model(model, eval_set, batch_size, reference)


def score(logits: Any, eval_set: EvalSet, reference: Any = None) -> dict[str, Any]:
    """The kind's scores for outputs on ``eval_set`` and, given the original's outputs, agreement and mean KL.

    Returns:
        ``{"samples", KEY: value per score column}``: for a classifier ``accuracy``, ``agreement`` and
        ``mean_kl``; for a language model also ``perplexity`` and ``tokens`` (the positions scored). The
        figures comparing with the original are ``None`` without a reference.
    """
    from optkit.kinds import get_kind

    return get_kind(eval_set.kind).score(logits, eval_set, reference)


def score_columns(eval_set: EvalSet) -> list[dict[str, str]]:
    """The figures the eval set's kind scores, as ``{"key", "label", "format"}`` for reports, in order."""
    from optkit.kinds import get_kind

    return [{"key": c.key, "label": c.label, "format": c.format} for c in get_kind(eval_set.kind).score_columns]
