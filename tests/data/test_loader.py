"""Tests for optkit/data/loader.py: the DataLoader whose worker count is measured."""

from __future__ import annotations

import pytest
import torch

from optkit.data import load_dataset
from optkit.data.loader import _pick, make_loader, worker_candidates


def test_loader_autotune_picks_a_valid_setting():
    ds = load_dataset("synthetic:512:1x28x28", "train")
    loader = make_loader(ds, 64, shuffle=True, budget_s=2.0)
    choice = loader.optkit_choice
    assert choice.tuned and choice.num_workers in worker_candidates()
    assert loader.num_workers == choice.num_workers
    assert set(choice.batches_per_s) <= set(worker_candidates()) and 0 in choice.batches_per_s
    assert loader.persistent_workers == (choice.num_workers > 0)
    assert "measured" in choice.describe()
    images, labels = next(iter(loader))
    assert images.shape == (64, 1, 28, 28) and labels.shape == (64,)


def test_loader_respects_an_explicit_worker_count():
    ds = load_dataset("synthetic:64:1x8x8", "train")
    loader = make_loader(ds, 16, num_workers=1, drop_last=True, seed=0)
    assert loader.num_workers == 1 and not loader.optkit_choice.tuned and loader.optkit_choice.batches_per_s == {}
    assert loader.persistent_workers and loader.prefetch_factor == 2 and not loader.pin_memory
    assert sum(len(y) for _, y in loader) == 64


def test_loader_pins_memory_for_cuda_only():
    ds = load_dataset("synthetic:8:1x8x8", "train")
    assert make_loader(ds, 4, num_workers=0, device="cuda").pin_memory
    assert not make_loader(ds, 4, num_workers=0, device="cpu").pin_memory


def test_loader_seed_makes_shuffling_reproducible():
    ds = load_dataset("synthetic:32:1x4x4", "val")
    first = [y for _, y in make_loader(ds, 8, shuffle=True, num_workers=0, seed=3)]
    second = [y for _, y in make_loader(ds, 8, shuffle=True, num_workers=0, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("bad", [-1, "many", 1.5, True])
def test_loader_rejects_bad_worker_counts(bad):
    with pytest.raises(ValueError, match="num_workers"):
        make_loader(load_dataset("synthetic:4", "val"), 2, num_workers=bad)


def test_pick_prefers_the_main_process_unless_workers_clearly_win():
    assert _pick({0: 100.0, 1: 110.0, 2: 120.0}) == 0
    assert _pick({0: 10.0, 1: 30.0, 2: 32.0}) == 1
    assert _pick({0: 10.0, 1: 15.0, 2: 40.0}) == 2
