"""What fine-tuning optimizes: AdamW's parameter groups, the learning-rate schedule, the distillation loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
#: A label that is not scored: a language model's position with no next token (padding, a block's end).
IGNORE_INDEX = -100


def output_logits(output: object) -> torch.Tensor:
    """The logits of a forward pass: the tensor itself, a Hugging Face output's ``logits``, or a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return output[0]


def scored_positions(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)`` of the scored positions only, one row each: a classifier's ``(batch, classes)`` as it
    is, a language model's ``(batch, length, vocabulary)`` flattened with :data:`IGNORE_INDEX` labels left out."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    keep = flat_labels != IGNORE_INDEX
    return flat_logits[keep], flat_labels[keep]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: decay on conv/linear (and other) weights, none on biases and norm parameters.

    Args:
        model: the model whose trainable parameters are grouped.
        weight_decay: the decay of the first group.

    Returns:
        two groups, ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]``.
    """
    no_decay_ids = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or name == "bias" or param.ndim <= 1:
                no_decay_ids.add(id(param))
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in no_decay_ids], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0},
    ]


def cosine_with_warmup(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier at each step: linear warmup to 1, then cosine decay to 0.

    Args:
        total_steps: the step at which the multiplier reaches 0.
        warmup_steps: steps of linear warmup (at least 1).

    Returns:
        ``factor(step) -> float``, for :class:`torch.optim.lr_scheduler.LambdaLR`.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *,
                      temperature: float, alpha: float) -> torch.Tensor:
    """Label cross-entropy mixed with KL divergence to the teacher's softened logits.

    ``(1 - alpha) * CE(student, labels) + alpha * T² * KL(softmax(teacher/T) || softmax(student/T))``;
    the ``T²`` keeps the soft term's gradients on the scale of the hard one's.

    Args:
        student: the trained model's logits, ``(batch, classes)``.
        teacher: the teacher's logits for the same inputs.
        labels: the class indices, ``(batch,)``.
        temperature: the softening temperature ``T``.
        alpha: the weight of the distillation term, in [0, 1].

    Returns:
        the scalar loss.
    """
    hard = F.cross_entropy(student, labels)
    soft = F.kl_div(F.log_softmax(student.float() / temperature, dim=-1),
                    F.log_softmax(teacher.float() / temperature, dim=-1),
                    reduction="batchmean", log_target=True)
    return (1.0 - alpha) * hard + alpha * temperature**2 * soft
