"""Which training samples each step sees: a capped subset, and a sampler that can resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler, Subset


def capped(dataset: Dataset, max_samples: int | None, seed: int) -> Dataset:
    """At most ``max_samples`` samples of ``dataset``: the first of a permutation seeded by ``seed``.

    The subset is the same on every rank and in a resumed run, and random rather
    than the dataset's first samples (which may be sorted by class).

    Args:
        dataset: the training split.
        max_samples: the cap; ``None`` keeps every sample.
        seed: seeds the permutation.

    Returns:
        ``dataset`` itself when it is within the cap, else a :class:`~torch.utils.data.Subset`
        (its indices in ascending order).
    """
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, sorted(order[:max_samples].tolist()))


class ResumableSampler(DistributedSampler):
    """DistributedSampler (a seeded permutation per epoch) that can start part-way through an epoch.

    Args:
        dataset: the training data.
        num_replicas: the world size.
        rank: this process's rank.
        seed: seeds each epoch's permutation (with the epoch number).
        start: samples of this rank's share to skip in the current epoch.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, start: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start
