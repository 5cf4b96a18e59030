"""A DataLoader whose worker count is chosen by measurement (tip 3: workers, pinned memory, prefetch)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)


@dataclass
class LoaderChoice:
    """What :func:`make_loader` chose and why.

    Attributes:
        num_workers: worker processes (0: load in the main process).
        pin_memory: page-locked host memory (on for CUDA).
        persistent_workers: keep workers alive between epochs.
        prefetch_factor: batches each worker loads ahead (``None`` without workers).
        tuned: whether ``num_workers`` was chosen by measurement.
        batches_per_s: measured loading rate per candidate worker count.
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    tuned: bool
    batches_per_s: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs and reports."""
        how = "measured" if self.tuned else "given"
        rates = ", ".join(f"{w}: {r:.0f}" for w, r in self.batches_per_s.items())
        tail = f" (batches/s by workers: {rates})" if rates else ""
        return f"num_workers={self.num_workers} ({how}), pin_memory={self.pin_memory}{tail}"


#: Seconds spent timing all candidate worker counts together.
TUNE_BUDGET_S = 3.0
#: Batches timed per candidate after one warm-up batch.
TUNE_BATCHES = 12
#: A worker count must load this much faster than the main process to be chosen:
#: workers share the CPU cores with the training step, which the timing does not see.
WORKER_MARGIN = 1.25


def worker_candidates() -> list[int]:
    """Worker counts tried by the tuner: 0, 1, 2, 4, ... up to the usable CPU cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates, n = [0], 1
    while n <= cores:
        candidates.append(n)
        n *= 2
    return candidates


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = False, num_workers: int | str = "auto",
                device: str | torch.device | None = None, drop_last: bool = False, sampler: Any = None,
                seed: int | None = None, budget_s: float = TUNE_BUDGET_S) -> DataLoader:
    """A DataLoader with ``num_workers`` chosen by timing a few batches per candidate.

    Each candidate in :func:`worker_candidates` loads a few batches within
    ``budget_s`` seconds in all; the fewest workers whose rate is within reach of
    the best wins, and a worker count must beat loading in the main process by
    :data:`WORKER_MARGIN`. Memory is pinned when ``device`` is CUDA; workers
    persist between epochs and prefetch 2 batches each. The choice is logged
    and kept on the loader as ``loader.optkit_choice`` (a :class:`LoaderChoice`).

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        shuffle: reshuffle every epoch (ignored when ``sampler`` is given).
        num_workers: ``"auto"`` to measure, or an explicit count that always wins.
        device: where batches go; CUDA turns on ``pin_memory``.
        drop_last: drop the last incomplete batch.
        sampler: a custom sampler (e.g. ``DistributedSampler``).
        seed: seeds the shuffling order for reproducible epochs.
        budget_s: time budget for the measurement.

    Returns:
        the configured DataLoader, with ``optkit_choice`` attached.

    Raises:
        ValueError: for a non-positive batch size or a bad ``num_workers``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_workers != "auto" and (not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0):
        raise ValueError(f"num_workers must be 'auto' or an integer >= 0, got {num_workers!r}")
    pin = torch.device(device).type == "cuda" if device is not None else False
    rates: dict[int, float] = {}
    if num_workers == "auto":
        rates = _time_candidates(dataset, batch_size, pin, budget_s)
        workers = _pick(rates)
    else:
        workers = num_workers
    choice = LoaderChoice(workers, pin, workers > 0, 2 if workers > 0 else None, num_workers == "auto", rates)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
                        num_workers=workers, pin_memory=pin, drop_last=drop_last, generator=generator,
                        persistent_workers=choice.persistent_workers, prefetch_factor=choice.prefetch_factor)
    loader.optkit_choice = choice
    log.info("data loader: %s", choice.describe())
    return loader


def _pick(rates: dict[int, float]) -> int:
    baseline = rates.get(0, 0.0)
    best = max(rates, key=lambda w: rates[w])
    if best == 0 or rates[best] < WORKER_MARGIN * baseline:
        return 0
    # Fewest workers within 10% of the best: extra workers only take cores from the training step.
    return min(w for w, r in rates.items() if r >= 0.9 * rates[best])


def _time_candidates(dataset: Dataset, batch_size: int, pin: bool, budget_s: float) -> dict[int, float]:
    candidates = worker_candidates()
    batches = max(2, min(TUNE_BATCHES + 1, len(dataset) // batch_size))
    rates: dict[int, float] = {}
    deadline = time.perf_counter() + budget_s
    for workers in candidates:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        sampler = torch.utils.data.RandomSampler(dataset, num_samples=min(len(dataset), batches * batch_size),
                                                 generator=torch.Generator().manual_seed(0))
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
                            prefetch_factor=2 if workers else None)
        rates[workers] = _batches_per_second(loader, time.perf_counter() + remaining / (len(candidates) - len(rates)))
    return rates


def _batches_per_second(loader: DataLoader, stop_at: float) -> float:
    iterator = iter(loader)
    try:
        next(iterator)  # the warm-up batch pays worker start-up, which persistent workers pay once
        start, count = time.perf_counter(), 0
        for _ in iterator:
            count += 1
            if time.perf_counter() >= stop_at:
                break
        elapsed = time.perf_counter() - start
    finally:
        del iterator
    return count / elapsed if count and elapsed > 0 else 0.0
