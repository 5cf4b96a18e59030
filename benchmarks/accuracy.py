"""Accuracy after pruning, and how much fine-tuning (with and without distillation) recovers.

Trains (or reloads) a small ResNet-style baseline on Fashion-MNIST, then for
structured pruning at about 2× and 3× fewer MACs and unstructured pruning at
50% / 80% reports test accuracy after pruning, after fine-tuning, and after
fine-tuning with distillation from the unpruned model, with MACs and params.

Run from the repository root::

    PYTHONPATH=. python benchmarks/accuracy.py

Writes ``benchmarks/results/accuracy.{json,md,png}``; the baseline is saved as
``benchmarks/results/fashion_resnet.pt`` (an optkit slimmed checkpoint) and
reused by later runs unless ``--retrain`` is given.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fashion_resnet import FashionResNet  # noqa: E402
from optkit import checkpoint, models  # noqa: E402
from optkit.data import load_dataset  # noqa: E402
from optkit.metrics import measure  # noqa: E402
from optkit.passes.prune import L1Unstructured, StructuredPrune  # noqa: E402
from optkit.train import TrainConfig, evaluate, fit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BASELINE = RESULTS / "fashion_resnet.pt"
ARCH = models.ArchSpec("benchmarks.fashion_resnet:FashionResNet", {"num_classes": 10})
INPUT_SHAPE = (1, 1, 28, 28)
DATA = "fashion-mnist"


def load_splits() -> dict[str, Dataset]:
    """Fashion-MNIST train (55k, augmented), val (5k held out of train) and test (10k) splits."""
    return {split: load_dataset(DATA, split) for split in ("train", "val", "test")}


def test_accuracy(model, splits) -> float:
    return evaluate(model, splits["test"], batch_size=500, device="cpu")["accuracy"]


def baseline(splits, args) -> tuple[torch.nn.Module, dict]:
    """Load the saved baseline, or train and save it."""
    if BASELINE.exists() and not args.retrain:
        model = models.load_model(BASELINE)
        return model, {"trained_now": False, "file": BASELINE.name}
    torch.manual_seed(args.seed)
    model = FashionResNet(num_classes=10).to(memory_format=torch.channels_last)
    config = TrainConfig(epochs=args.baseline_epochs, batch_size=128, lr=3e-3, weight_decay=0.05, warmup=0.03,
                         amp="bf16", seed=args.seed, progress=args.progress, device="cpu",
                         checkpoint=args.checkpoint, checkpoint_every=100, resume=args.checkpoint is not None)
    start = time.perf_counter()
    result = fit(model, splits["train"], splits["val"], config)
    seconds = time.perf_counter() - start
    checkpoint.save(result.model, BASELINE, ARCH, extra={"trained_by": "benchmarks/accuracy.py"})
    return result.model, {"trained_now": True, "file": BASELINE.name, "epochs": args.baseline_epochs,
                          "seconds": round(seconds, 1), "history": result.history,
                          "best_epoch": result.best_epoch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-epochs", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2, help="fine-tune epochs per pruned model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retrain", action="store_true", help="train the baseline even if it is saved")
    parser.add_argument("--baseline-only", action="store_true", help="stop after the baseline")
    parser.add_argument("--checkpoint", help="training checkpoint of the baseline (resumed if it exists)")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    args = parser.parse_args()
    torch.set_num_threads(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    splits = load_splits()
    model, baseline_info = baseline(splits, args)
    base_stats = measure(model, INPUT_SHAPE)
    base_acc = test_accuracy(model, splits)
    print(f"baseline: test accuracy {base_acc:.4f}, {base_stats.macs:,} MACs, {base_stats.params:,} params", flush=True)
    if args.baseline_only:
        return


if __name__ == "__main__":
    main()
