"""Model measurements: parameters, MACs, weight sparsity, latency, file size."""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from optkit.kinds import example_inputs, model_device

__all__ = ["PRUNABLE_WEIGHT_TYPES", "ModelStats", "count_macs", "count_params", "detach_caches", "eval_mode",
           "example_input", "file_size", "fingerprint", "measure", "model_device", "prunable_weights", "summarize_ms",
           "time_callable", "weight_sparsity"]

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
        zeros += int((weight == 0).sum())
        total += weight.numel()
    return zeros / total if total else 0.0


def example_input(model: nn.Module, input_shape: Sequence[int], *, seed: int = 0) -> Any:
    """A reproducible example input of ``input_shape`` on the model's device, such that ``model(x)`` runs.

    What it is depends on the model's kind (:func:`optkit.kinds.kind_of`): an
    image batch, token ids, or a list of images. :func:`optkit.kinds.example_inputs`
    gives the whole call (an attention mask too).
    """
    return example_inputs(model, input_shape, seed=seed).first()


def detach_caches(model: nn.Module) -> nn.Module:
    """Detach, in place, tensors ``model``'s modules keep outside their parameters and buffers (a cache filled by a
    forward pass, such as attention biases gathered in eval mode) that carry autograd history: deep copies of the
    model, which every trial prune makes, refuse such tensors. Returns ``model``."""
    from torch.utils._pytree import tree_leaves, tree_map

    def detached(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) and not value.is_leaf else value

    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor | dict | list | tuple) and not name.startswith("_"):
                leaves = tree_leaves(value)
                if any(isinstance(leaf, torch.Tensor) and not leaf.is_leaf for leaf in leaves):
                    setattr(module, name, tree_map(detached, value))
    return model


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block, then restore the train/eval mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def count_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """MACs per sample: one forward pass at batch size 1, whatever the batch in ``input_shape``.

    Counted by torch-pruning's op counter in eval mode (which scales some ops
    by the batch and others not, so a larger batch gives neither the per-sample
    nor the whole-batch count).
    """
    import torch_pruning as tp

    # The counter puts the model in eval mode itself; eval_mode restores the caller's mode.
    with eval_mode(model), torch.no_grad():
        inputs = example_inputs(model, (1, *input_shape[1:]))
        # The counter prints a warning for keyword-only calls (a token model's); the count is right.
        with contextlib.redirect_stdout(io.StringIO()):
            macs, _ = tp.utils.count_ops_and_params(model, inputs.packed())
    return int(macs)


def measure(model: nn.Module, input_shape: Sequence[int]) -> ModelStats:
    """Params, MACs and sparsity of ``model`` at ``input_shape``."""
    return ModelStats(params=count_params(model), macs=count_macs(model, input_shape), sparsity=weight_sparsity(model))


def time_callable(fn, *, warmup: int = 3, repeats: int = 20) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns:
        median, p90, min and max latency in milliseconds, and the spread
        (p90 / median), so noise is reported rather than hidden.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
    return summarize_ms(samples)


def summarize_ms(samples: list[float]) -> dict[str, float]:
    """Median, p90, min, max (milliseconds), spread (p90 / median) and count of timed samples."""
    samples = sorted(samples)
    median = statistics.median(samples)
    p90 = samples[min(len(samples) - 1, int(round(0.9 * (len(samples) - 1))))]
    return {"median_ms": median, "p90_ms": p90, "min_ms": samples[0], "max_ms": samples[-1],
            "spread": p90 / median if median else 0.0, "repeats": len(samples)}


def file_size(path: str | os.PathLike) -> int:
    """Size of a file in bytes."""
    return os.path.getsize(path)


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's architecture (its module tree as printed) and every parameter and buffer's bytes."""
    import hashlib

    digest = hashlib.sha256(repr(model).encode())
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]
