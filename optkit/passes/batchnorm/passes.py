"""BatchNorm passes: insert after convolutions, fold into them for inference, recalibrate after pruning.

* :func:`insert_batchnorm` puts a BatchNorm after every convolution that is not
  already followed by a normalization layer, set up so the model computes the
  same function (train with it: BatchNorm speeds up and stabilizes training).
* :func:`~optkit.model.batchnorm.fold_batchnorm` (the engine, on the ground floor
  where export uses it too) merges each BatchNorm into the conv or linear layer
  that feeds it, so it costs nothing at inference.
* :func:`recalibrate_batchnorm` re-estimates running statistics from data, which
  pruning leaves stale.

"Followed by" and "feeds" are decided from the data flow (torch.fx, or the
autograd graph of one forward pass where fx cannot trace; see
:mod:`optkit.model.dataflow`), never from module order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult, Stage
from optkit.core.registry import register_pass
from optkit.core.settings import calib_data_setting, setting, shared_setting, workers_setting

if TYPE_CHECKING:
    import torch
    from torch import nn

SPLITS = ("train", "val", "test")
# Layers a conv's output may pass through and still count as "followed by" the norm after them.
_PASSTHROUGH = ("ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
                "Hardswish", "Hardtanh", "Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d")


def insert_batchnorm(model: nn.Module, calibration: Iterable[Any] | None = None, *,
                     input_shape: tuple[int, ...] | None = None, eps: float = 1e-5,
                     momentum: float = 0.1) -> dict[str, Any]:
    """Insert a BatchNorm after every convolution not already followed by a normalization layer.

    Each such conv is replaced in its parent by
    :class:`~optkit.passes.batchnorm.modules.ConvBatchNorm` ``(conv, bn)``, with
    ``BatchNorm1d/2d/3d`` matching the conv. The model computes the same function:

    * without ``calibration``, each BN is an exact identity in eval mode
      (``running_mean = 0``, ``running_var = 1 - eps``, ``weight = 1``, ``bias = 0``);
    * with it, each BN's running statistics are the per-channel mean and
      variance of its input over those batches, and its affine parameters undo
      them (``weight = sqrt(var + eps)``, ``bias = mean``): eval mode is again
      an identity, and train mode, which normalizes with batch statistics
      close to those, starts close to the original model.

    Args:
        model: the model, changed in place.
        calibration: batches of inputs (tensors, or tuples/lists whose first
            item is the input), e.g. a few batches of a DataLoader.
        input_shape: example input shape, used only when torch.fx cannot trace
            the model (the autograd-graph fallback runs one forward pass).
        eps: the new BatchNorms' epsilon.
        momentum: the new BatchNorms' momentum for later training.

    Returns:
        details: ``inserted`` (conv names), ``already_normalized`` (conv names),
        ``not_run`` (convs the forward pass never reaches), ``dataflow``, and
        ``calibration_batches`` when data was given.

    Raises:
        ValueError: if ``calibration`` holds no batches, or the data flow cannot be found.
    """
    from torch import nn

    from optkit.model.dataflow import data_flow
    from optkit.model.inputs import example_input
    from optkit.model.state import set_submodule
    from optkit.passes.batchnorm.modules import ConvBatchNorm

    flow = data_flow(model, example_input(model, input_shape or DEFAULT_INPUT_SHAPE))
    modules = dict(model.named_modules())
    convs = [name for name, m in modules.items() if name and isinstance(m, nn.modules.conv._ConvNd)]
    details: dict[str, Any] = {"inserted": [], "already_normalized": [], "not_run": [], **flow.details()}
    new_bns = []
    for name in convs:
        if flow.calls[name] == 0:
            details["not_run"].append(name)
        elif _followed_by_norm(name, flow, modules):
            details["already_normalized"].append(name)
        else:
            conv = modules[name]
            bn = _batchnorm_for(conv, eps, momentum)
            set_submodule(model, name, ConvBatchNorm(conv, bn))
            new_bns.append(bn)
            details["inserted"].append(name)
    if calibration is not None:
        details["calibration_batches"] = _calibrate(model, new_bns, calibration) if new_bns else 0
    return details


def recalibrate_batchnorm(model: nn.Module, batches: Iterable[Any], *, num_batches: int | None = None) -> dict[str, Any]:
    """Re-estimate every BatchNorm's running statistics from data; no weight changes.

    The statistics are reset and recomputed as a cumulative average
    (``momentum=None``) over the batches, with the BatchNorms in train mode and
    every other module in eval mode (dropout off), under ``torch.no_grad()``.
    Modes and momenta are restored afterwards. A BatchNorm the forward pass
    never reaches keeps its old statistics, and so does every BatchNorm when
    a batch fails.

    Args:
        model: the model, changed in place.
        batches: inputs (tensors, or tuples/lists whose first item is the input).
        num_batches: use at most this many batches (all when ``None``).

    Returns:
        details: ``recalibrated`` (number of BatchNorms updated), ``batches``
        used, ``not_reached`` (BatchNorm names the data never reached).

    Raises:
        ValueError: if there are no batches.
    """
    import torch
    from torch import nn

    bns = {name: m for name, m in model.named_modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
    if not bns:
        return {"recalibrated": 0, "batches": 0, "not_reached": []}
    saved = {name: (bn.momentum, {k: v.clone() for k, v in bn.named_buffers(recurse=False)}) for name, bn in bns.items()}
    reached: set[str] = set()
    handles = [bn.register_forward_pre_hook(lambda m, args, name=name: reached.add(name)) for name, bn in bns.items()]
    modes = {m: m.training for m in model.modules()}
    used, finished = 0, False
    try:
        model.eval()
        for bn in bns.values():
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        with torch.no_grad():
            for batch in _take(batches, num_batches):
                model(_batch_input(batch, model))
                used += 1
        finished = used > 0
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
        for name, bn in bns.items():
            momentum, buffers = saved[name]
            bn.momentum = momentum
            # A failed or empty run leaves every statistic as it was.
            if name not in reached or not finished:
                for key, value in buffers.items():
                    getattr(bn, key).copy_(value)
    if used == 0:
        raise ValueError("recalibrate_batchnorm got no batches; give it a non-empty data source")
    return {"recalibrated": len(reached), "batches": used, "not_reached": sorted(set(bns) - reached)}


@register_pass
@dataclass(frozen=True)
class InsertBatchNorm(Pass):
    """Insert a function-preserving BatchNorm after every conv that lacks a normalization layer.

    Without ``data`` the new BatchNorms start as exact identities. Works in
    place; see :func:`insert_batchnorm`.
    """

    name = "insert_batchnorm"
    stage = Stage.PREPARE
    flag = "insert-bn"
    data: str | None = calib_data_setting()
    batches: int = setting(4, help="How many batches of data to use.", low=1)
    batch_size: int = setting(32, help="Calibration batch size.", low=2)
    split: str = setting("train", help="The dataset split to draw from.", choices=SPLITS)
    num_workers: int | str = workers_setting(0)
    eps: float = setting(1e-5, help="The new BatchNorms' epsilon.", low=1e-12, high=0.1)
    momentum: float = setting(0.1, help="The new BatchNorms' momentum for later training.", low=1e-6, high=1.0)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def apply(self, model: nn.Module) -> PassResult:
        calibration = None
        if self.data is not None:
            calibration = _data_batches(self.data, self.split, self.batch_size, self.batches, self.num_workers,
                                        self.input_shape)
        details = insert_batchnorm(model, calibration, input_shape=self.input_shape, eps=self.eps,
                                   momentum=self.momentum)
        return PassResult(model, details)


@register_pass
@dataclass(frozen=True)
class FoldBatchNorm(Pass):
    """Fold BatchNorms into the conv/linear layers that feed them, for inference and export.

    Works in place; see :func:`optkit.model.batchnorm.fold_batchnorm`. BatchNorms that cannot be
    folded are left in place and listed in the details with the reason.
    """

    name = "fold_batchnorm"
    stage = Stage.FOLD
    flag = "fold-bn"
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def apply(self, model: nn.Module) -> PassResult:
        from optkit.model.batchnorm import fold_batchnorm

        return PassResult(model, fold_batchnorm(model, input_shape=self.input_shape))


@register_pass
@dataclass(frozen=True)
class RecalibrateBatchNorm(Pass):
    """Re-estimate BatchNorm running statistics from data (after pruning); no weight updates.

    The images are adapted to ``input_shape`` as training adapts them (grayscale
    repeated to the model's channels, resized to its height and width; see
    :mod:`optkit.data.adapt`). Works in place; see :func:`recalibrate_batchnorm`.
    """

    name = "recalibrate_batchnorm"
    stage = Stage.RECALIBRATE
    data: str | None = calib_data_setting(example="synthetic:64:3x16x16:10")
    batches: int = setting(10, help="Re-estimate the statistics from this many batches of data.", low=1,
                           flag="recalibrate-bn", enables=True, metavar="N")
    batch_size: int = setting(32, help="Batch size (train-mode BatchNorm needs more than one value per channel).",
                              low=2)
    split: str = setting("train", help="The dataset split to draw from.", choices=SPLITS)
    num_workers: int | str = workers_setting(0)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def check(self) -> None:
        if self.data is None:
            raise ValueError("recalibrating BatchNorm needs data: set data to a dataset spec such as 'fashion-mnist'")

    def apply(self, model: nn.Module) -> PassResult:
        batches = _data_batches(self.data, self.split, self.batch_size, self.batches, self.num_workers,
                                self.input_shape)
        details = recalibrate_batchnorm(model, batches, num_batches=self.batches)
        details["data"] = self.data
        return PassResult(model, details)


def _data_batches(spec: str, split: str, batch_size: int, count: int, num_workers: int | str,
                  input_shape: tuple[int, ...] | None) -> list[Any]:
    from optkit.data import load_dataset, make_loader
    from optkit.data.adapt import adapted

    # No augmentation: the statistics should match what the model sees at inference.
    dataset = load_dataset(spec, split, augment=False)
    if input_shape is not None:
        dataset = adapted(dataset, input_shape)
    loader = make_loader(dataset, batch_size, shuffle=True, num_workers=num_workers, seed=0, drop_last=True)
    return list(itertools.islice(loader, count))


def _followed_by_norm(name: str, flow, modules: dict[str, nn.Module]) -> bool:
    from torch import nn

    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
    seen = set()
    frontier = list(flow.users[name])
    while frontier:
        user = frontier.pop()
        module = modules.get(user)
        if module is None or user in seen:
            continue
        seen.add(user)
        if isinstance(module, norms):
            return True
        if type(module).__name__ in _PASSTHROUGH and type(module).__module__.startswith("torch.nn"):
            frontier.extend(flow.users[user])
    return False


def _batchnorm_for(conv: nn.Module, eps: float, momentum: float) -> nn.Module:
    import torch
    from torch import nn

    kind = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(conv.kernel_size)]
    bn = kind(conv.out_channels, eps=eps, momentum=momentum)
    with torch.no_grad():
        # (x - 0) / sqrt((1 - eps) + eps) * 1 + 0 == x: an identity in eval mode.
        bn.running_var.fill_(1.0 - eps)
    return bn.to(device=conv.weight.device, dtype=conv.weight.dtype if conv.weight.is_floating_point() else torch.float32)


def _calibrate(model: nn.Module, bns: list[nn.Module], calibration: Iterable[Any]) -> int:
    """Set each new BN's statistics from its inputs; the BNs are still identities meanwhile."""
    import torch

    from optkit.model.state import eval_mode

    sums: dict[int, list[Any]] = {}

    def accumulate(bn, args):
        x = args[0].detach().to(torch.float64).transpose(0, 1).reshape(args[0].shape[1], -1)
        total = sums.setdefault(id(bn), [0, 0.0, 0.0])
        total[0] += x.shape[1]
        total[1] = total[1] + x.sum(dim=1)
        total[2] = total[2] + (x * x).sum(dim=1)

    handles = [bn.register_forward_pre_hook(accumulate) for bn in bns]
    used = 0
    try:
        with eval_mode(model), torch.no_grad():
            for batch in calibration:
                model(_batch_input(batch, model))
                used += 1
    finally:
        for handle in handles:
            handle.remove()
    if used == 0:
        raise ValueError("insert_batchnorm got an empty calibration source; give it at least one batch")
    with torch.no_grad():
        for bn in bns:
            count, total, squares = sums[id(bn)]
            mean = total / count
            var = (squares / count - mean * mean).clamp(min=0) * (count / max(count - 1, 1))
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
            bn.weight.copy_((var + bn.eps).sqrt())
            bn.bias.copy_(mean)
            bn.num_batches_tracked.fill_(used)
    return used


def _batch_input(batch: Any, model: nn.Module) -> torch.Tensor:
    import torch

    from optkit.kinds import model_device

    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise ValueError(f"a data batch must be a tensor or a (inputs, targets) pair, got {type(batch).__name__}")
    return batch.to(model_device(model), non_blocking=True)


def _take(batches: Iterable[Any], count: int | None) -> Iterable[Any]:
    return batches if count is None else itertools.islice(batches, count)
