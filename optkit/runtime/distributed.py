"""Distributed runs under ``torchrun``: joining the process group, this process's rank, DDP helpers.

``torchrun`` describes the process group in the environment (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``); :func:`init_distributed` joins it (nccl on CUDA,
gloo on CPU). Outside a distributed launch every helper here is a no-op and
the rank and world size are ``0`` and ``1``.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def init_distributed() -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment, if any.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` outside a distributed launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """Whether this process should write files (rank 0, or not distributed).

    Returns:
        ``True`` on rank 0 (read from ``RANK`` before the process group is joined).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def launch_rank() -> tuple[int, int]:
    """This process's rank and the world size: the joined process group's, else what ``torchrun`` set.

    Unlike :func:`rank_and_world`, this answers before the process group is joined (from ``RANK``
    and ``WORLD_SIZE``), so a run knows which process writes its files from the start.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` outside a distributed launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of the joined process group.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when no process group is joined.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` wrapped in DistributedDataParallel on ``device``, or as it is outside a process group.

    Args:
        model: the model to train (already on ``device``).
        device: this rank's device.

    Returns:
        the module to call in the training loop.
    """
    if rank_and_world()[1] == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place.

    Args:
        tensor: the same shape on every rank.

    Returns:
        ``tensor``, now holding the sum.
    """
    if rank_and_world()[1] > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor


def all_finite(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank.

    Every rank must agree, or the ones that stop would leave the others waiting in all-reduce.

    Args:
        loss: this rank's loss.

    Returns:
        ``True`` only when it is finite everywhere.
    """
    finite = torch.isfinite(loss.detach()).float().reshape(1)
    if rank_and_world()[1] > 1:
        import torch.distributed as dist

        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics).

    DDP syncs buffers at the start of each forward, so after the last step every
    rank holds statistics of its own batch; this takes rank 0's, as DDP would next.

    Args:
        model: the unwrapped model.
    """
    if rank_and_world()[1] == 1:
        return
    import torch.distributed as dist

    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
