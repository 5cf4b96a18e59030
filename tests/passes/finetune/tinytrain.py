"""A tiny classification task the training-loop tests share (also imported by their subprocess scripts)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from optkit.passes.finetune.passes import FineTune

#: Any spec will do: fit trains on the dataset it is given and never reads ``data``.
DATA = "synthetic:96:1x6x6:3"


def tiny_data(n: int = 96, seed: int = 0) -> TensorDataset:
    """``n`` 1x6x6 inputs labelled by a fixed random linear map (3 classes, learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    y = (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1)
    return TensorDataset(x, y)


def tiny_model() -> nn.Module:
    """A conv, BatchNorm, dropout and linear layer (seeded, so every call starts from the same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.2), nn.Linear(144, 3))


def tiny_settings(**changes: Any) -> FineTune:
    """FineTune settings for the tiny task: batches of 16, in-process data loading."""
    return FineTune(**{"data": DATA, "batch_size": 16, "lr": 1e-2, "num_workers": 0, **changes})


def resume_settings(checkpoint: str, resume: bool) -> FineTune:
    """The settings of the SIGKILL-and-resume run: 3 epochs of 6 steps, a checkpoint every 4 steps."""
    return tiny_settings(epochs=3, lr=5e-3, amp="off", checkpoint=checkpoint, checkpoint_every=4, resume=resume,
                         seed=7)


class CountingData(Dataset):
    """Wraps a dataset and records every batch of indices the loader fetches."""

    def __init__(self, data: Dataset):
        self.data, self.batches = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]

    def __getitems__(self, indices: list[int]):
        self.batches.append(list(indices))
        return [self.data[i] for i in indices]
