"""A model's size and cost: parameters, MACs, weight sparsity, and a fingerprint of its weights."""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from optkit.kinds import example_inputs
from optkit.model.state import eval_mode

__all__ = ["PRUNABLE_WEIGHT_TYPES", "ModelStats", "count_macs", "count_params", "fingerprint", "measure",
           "prunable_weights", "weight_sparsity"]

PRUNABLE_WEIGHT_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


@dataclass
class ModelStats:
    """Size and cost of a model at one input shape.

    Attributes:
        params: number of parameter elements.
        macs: multiply-accumulates of one forward pass at ``input_shape``.
        sparsity: fraction of exactly-zero elements in conv/linear weights.
    """

    params: int
    macs: int
    sparsity: float

    def to_dict(self) -> dict:
        return asdict(self)


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def prunable_weights(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs whose ``weight`` optkit's pruning and sparsity consider."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PRUNABLE_WEIGHT_TYPES)]


def weight_sparsity(model: nn.Module) -> float:
    """Exact fraction of zero elements across all conv and linear weights."""
    zeros = total = 0
    for _, module in prunable_weights(model):
        weight = module.weight.detach()
        # count_nonzero allocates nothing of the weight's size (``(weight == 0).sum()`` makes a bool and an int64 copy).
        zeros += weight.numel() - int(torch.count_nonzero(weight))
        total += weight.numel()
    return zeros / total if total else 0.0


def count_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """MACs per sample: one forward pass at batch size 1, whatever the batch in ``input_shape``.

    Counted by torch-pruning's op counter in eval mode (which scales some ops
    by the batch and others not, so a larger batch gives neither the per-sample
    nor the whole-batch count).
    """
    import types
    from unittest import mock

    import torch_pruning as tp
    from torch_pruning.utils import op_counter

    # The counter deep-copies the model to hang its hooks on; the copy's modules are new but its parameters and
    # buffers are the model's own, so counting a 16 GB model does not hold a second 16 GB.
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    sharing = types.SimpleNamespace(deepcopy=lambda module: copy.deepcopy(module, dict(shared)))
    # The counter puts the model in eval mode itself; eval_mode restores the caller's mode.
    with eval_mode(model), torch.no_grad(), mock.patch.object(op_counter, "copy", sharing):
        inputs = example_inputs(model, (1, *input_shape[1:]))
        # The counter prints a warning for keyword-only calls (a token model's); the count is right.
        with contextlib.redirect_stdout(io.StringIO()):
            macs, _ = tp.utils.count_ops_and_params(model, inputs.packed())
    return int(macs)


def measure(model: nn.Module, input_shape: Sequence[int]) -> ModelStats:
    """Params, MACs and sparsity of ``model`` at ``input_shape``."""
    return ModelStats(params=count_params(model), macs=count_macs(model, input_shape), sparsity=weight_sparsity(model))


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's architecture (its module tree as printed) and every parameter and buffer's bytes."""
    import hashlib

    digest = hashlib.sha256(repr(model).encode())
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]
