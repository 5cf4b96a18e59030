"""Benchmark the BatchNorm passes on Fashion-MNIST and torchvision models.

Three measurements, written to benchmarks/results/batchnorm.{json,md}:

1. **Training with inserted BatchNorm.** A BN-free VGG-style CNN (six 3x3
   convs) is trained from scratch three times from the same initial weights
   and the same batches: as is; after ``insert_batchnorm`` without data (each
   BN an identity in eval mode, a standard BN in train mode); and after
   ``insert_batchnorm`` calibrated on 4 batches (train mode also starts close
   to the plain model). Test accuracy per epoch.
2. **Folding for inference.** Eval-mode latency (torch eager, CPU, median)
   of resnet18, resnet50 and mobilenet_v2 before and after ``fold_batchnorm``,
   at batch 1 and 8, with the output difference.
3. **Recalibration after pruning.** The BN model trained in (1) without
   calibration data is pruned by
   50% (structured, L1) and its test accuracy measured before and after
   ``recalibrate_batchnorm`` with a few batch counts, before any fine-tune.

Run it alone (timings): ``flock /tmp/optkit-bench.lock python benchmarks/batchnorm.py``, or one
part at a time with ``--only learning`` (accuracy, no lock needed) and ``--only fold`` (latency,
under the lock); each part updates its own section of the results files.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

from optkit.analysis.latency import time_callable
from _results import destination, partial_options

from optkit.core.files import write_text
from optkit.data import load_dataset, make_loader
from optkit.model.stats import count_params
from optkit.passes.batchnorm import fold_batchnorm, insert_batchnorm, recalibrate_batchnorm
from optkit.passes.prune.passes import StructuredPrune

RESULTS = Path(__file__).resolve().parent / "results"
FOLD_MODELS = ("resnet18", "resnet50", "mobilenet_v2")


def vgg_style(channels=(16, 32, 64), classes: int = 10) -> nn.Sequential:
    """A BN-free VGG-style CNN for 1x28x28 images: two 3x3 convs per stage, max-pool between stages."""
    layers: list[nn.Module] = []
    c_in = 1
    for c in channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU(inplace=True),
                   nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        c_in = c
    layers += [nn.Flatten(), nn.Linear(c_in * 3 * 3, classes)]
    return nn.Sequential(*layers)


def accuracy(model: nn.Module, loader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return correct / total


def train(model: nn.Module, train_loader, test_loader, epochs: int, lr: float, seed: int) -> list[dict]:
    """Plain SGD with momentum; the same seed gives the same batch order for every model."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    history = []
    torch.manual_seed(seed)
    for epoch in range(1, epochs + 1):
        model.train()
        start, losses = time.perf_counter(), []
        for x, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        history.append({"epoch": epoch, "train_loss": sum(losses) / len(losses),
                        "test_acc": accuracy(model, test_loader), "epoch_s": seconds})
        print(f"  epoch {epoch}: loss {history[-1]['train_loss']:.3f} acc {history[-1]['test_acc']:.4f} ({seconds:.0f}s)",
              flush=True)
    return history


def loaders(args):
    train_set = load_dataset("fashion-mnist", "train")
    subset = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))[: args.train_size]
    train_set = torch.utils.data.Subset(train_set, subset.tolist())
    calib_set = load_dataset("fashion-mnist", "train", augment=False)
    test_set = load_dataset("fashion-mnist", "test")
    test_subset = torch.randperm(len(test_set), generator=torch.Generator().manual_seed(args.seed))[: args.test_size]
    test_set = torch.utils.data.Subset(test_set, test_subset.tolist())
    return (make_loader(train_set, args.batch_size, shuffle=True, seed=args.seed, num_workers=0),
            make_loader(calib_set, args.batch_size, shuffle=True, seed=args.seed + 1, num_workers=0),
            make_loader(test_set, 500, num_workers=0))


def bench_training(args, train_loader, calib_loader, test_loader) -> tuple[dict, nn.Module]:
    torch.manual_seed(args.seed)
    plain = vgg_style()
    with_bn = copy.deepcopy(plain)
    details = insert_batchnorm(with_bn, input_shape=(1, 1, 28, 28))
    calibrated = copy.deepcopy(plain)
    insert_batchnorm(calibrated, _first(calib_loader, 4), input_shape=(1, 1, 28, 28))
    out = {"model": "vgg-style 6 conv (16-32-64) + linear, no BN", "params_plain": count_params(plain),
           "params_bn": count_params(with_bn), "inserted": details["inserted"]}
    for name, model in (("plain", plain), ("insert_batchnorm", with_bn), ("insert_batchnorm_calibrated", calibrated)):
        print(f"training {name}", flush=True)
        out[name] = {"initial_test_acc": accuracy(model, test_loader),
                     "epochs": train(model, train_loader, test_loader, args.epochs, args.lr, args.seed)}
    return out, with_bn


def bench_fold(args) -> list[dict]:
    rows = []
    for name in FOLD_MODELS:
        torch.manual_seed(args.seed)
        model = torchvision.models.get_model(name, weights=None).eval()
        _randomize_bn(model)
        folded = copy.deepcopy(model)
        details = fold_batchnorm(folded, input_shape=(1, 3, 224, 224))
        for batch in (1, 8):
            x = torch.randn(batch, 3, 224, 224)
            with torch.no_grad():
                ref, out = model(x), folded(x)
                rel = float((out - ref).norm() / ref.norm())
                repeats = args.repeats if batch == 1 else max(3, args.repeats // 2)
                before, after = _interleaved(lambda: model(x), lambda: folded(x), repeats)
            rows.append({"model": name, "batch": batch, "folded_bn": len(details["folded"]),
                         "left_bn": len(details["not_folded"]), "rel_err": rel,
                         "before_ms": before["median_ms"], "after_ms": after["median_ms"],
                         "before_spread": before["spread"], "after_spread": after["spread"],
                         "speedup": before["median_ms"] / after["median_ms"], "repeats": repeats})
            print(f"  {name} b{batch}: {before['median_ms']:.1f} -> {after['median_ms']:.1f} ms (rel err {rel:.1e})",
                  flush=True)
    return rows


def _interleaved(first, second, repeats: int) -> tuple[dict, dict]:
    """Time two callables in alternating single runs, so load that drifts over time hits both alike."""
    results: tuple[list, list] = ([], [])
    for _ in range(repeats):
        for fn, samples in zip((first, second), results):
            samples.append(time_callable(fn, warmup=0 if samples else 1, repeats=1)["median_ms"])
    return tuple(_summary(samples) for samples in results)


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    median = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median_ms": median, "spread": p90 / median}


def bench_recalibration(args, trained: nn.Module, calib_loader, test_loader) -> dict:
    pruned = copy.deepcopy(trained)
    trained_acc = accuracy(trained, test_loader)
    StructuredPrune(ratio=0.5, input_shape=(1, 1, 28, 28))(pruned)
    out = {"ratio": 0.5, "method": "structured_prune (L1, round_to=8)", "params_before": count_params(trained),
           "params_after": count_params(pruned), "test_acc_trained": trained_acc,
           "test_acc_pruned": accuracy(pruned, test_loader), "recalibrated": []}
    for batches in args.recal_batches:
        model = copy.deepcopy(pruned)
        recalibrate_batchnorm(model, calib_loader, num_batches=batches)
        out["recalibrated"].append({"batches": batches, "images": batches * args.batch_size,
                                    "test_acc": accuracy(model, test_loader)})
        print(f"  recalibrated on {batches} batches: acc {out['recalibrated'][-1]['test_acc']:.4f}", flush=True)
    return out


def _first(loader, n):
    return [batch for _, batch in zip(range(n), loader)]


def _randomize_bn(model: nn.Module) -> None:
    # Fresh BNs are identities (mean 0, var 1, weight 1, bias 0), which would make folding trivially exact.
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)


def to_markdown(results: dict) -> str:
    lines = ["# BatchNorm passes", "",
             "Sections come from separate runs (the accuracy runs need no exclusive CPU; the latency run is "
             "taken under `flock /tmp/optkit-bench.lock`); each names its command.", ""]
    if "learning" in results:
        lines += _learning_markdown(results["learning"])
    if "fold" in results:
        lines += _fold_markdown(results["fold"])
    return "\n".join(lines) + "\n"


def _run_line(run: dict) -> list[str]:
    load = run.get("load_average_1min_at_end")
    load_text = f"; 1-minute load average at its end: {load:.1f}" if load is not None else ""
    return [f"Command: `{run['command']}`", "",
            f"Machine: {run['machine']}; torch {run['torch']}. Run took {run['seconds']:.0f} s{load_text} "
            "(the machine's 2 cores are shared with other jobs).", ""]


def _learning_markdown(run: dict) -> list[str]:
    t, r, a = run["training"], run["recalibration"], run["args"]
    lines = ["## 1. Training a BN-free CNN with and without `insert_batchnorm`", "", *_run_line(run),
             f"{t['model']}; Fashion-MNIST: {a['train_size']} training images and {a['test_size']} test images "
             "(fixed random subsets, so the run fits a few minutes on 2 shared CPU cores; training images with "
             "the train split's random crop and flip); SGD momentum 0.9, "
             f"lr {a['lr']}, batch {a['batch_size']}, the same initial weights and batch order for all three. "
             f"BN inserted after {len(t['inserted'])} convs. Test accuracy:", "",
             "| epoch | plain | + insert_batchnorm (no data) | + insert_batchnorm (calibrated, 4 batches) |",
             "|---|---|---|---|"]
    arms = [t["plain"], t["insert_batchnorm"], t["insert_batchnorm_calibrated"]]
    lines.append("| 0 (start) | " + " | ".join(f"{arm['initial_test_acc']:.4f}" for arm in arms) + " |")
    for epoch, rows in enumerate(zip(*(arm["epochs"] for arm in arms)), start=1):
        lines.append(f"| {epoch} | " + " | ".join(f"{row['test_acc']:.4f}" for row in rows) + " |")
    lines += ["", "Seconds per training epoch (shared CPU, indicative only): " + ", ".join(
        f"{name} {sum(e['epoch_s'] for e in arm['epochs']) / len(arm['epochs']):.0f}"
        for name, arm in zip(("plain", "no data", "calibrated"), arms)) + ".", ""]
    lines += ["## 3. Recalibration after 50% structured pruning (no fine-tune)", "",
              f"The model trained in section 1 with BN inserted without data, pruned with {r['method']} at ratio "
              f"{r['ratio']} ({r['params_before']} -> {r['params_after']} params); test accuracy on the same test "
              "images; recalibration batches drawn from the training split without augmentation.", "",
              "| model | test acc |", "|---|---|",
              f"| trained, before pruning | {r['test_acc_trained']:.4f} |",
              f"| pruned, stale BN statistics | {r['test_acc_pruned']:.4f} |"]
    for row in r["recalibrated"]:
        lines.append(f"| pruned, recalibrated on {row['batches']} batches ({row['images']} images) | {row['test_acc']:.4f} |")
    return lines + [""]


def _fold_markdown(run: dict) -> list[str]:
    lines = ["## 2. Eval latency before and after `fold_batchnorm` (torch eager, CPU, 224x224)", "", *_run_line(run),
             f"Random weights with randomized BN statistics; timing: {run.get('timing', 'all unfolded runs, then all folded runs')}; "
             "median of the repeats; spread = p90/median. A speedup means something only where it is larger "
             "than the spreads.", "",
             "| model | batch | BN folded | BN left | before ms | after ms | speedup | rel. output error |",
             "|---|---|---|---|---|---|---|---|"]
    for row in run["rows"]:
        lines.append(f"| {row['model']} | {row['batch']} | {row['folded_bn']} | {row['left_bn']} | "
                     f"{row['before_ms']:.1f} (spread {row['before_spread']:.2f}) | "
                     f"{row['after_ms']:.1f} (spread {row['after_spread']:.2f}) | {row['speedup']:.2f}x | "
                     f"{row['rel_err']:.1e} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("learning", "fold"),
                        help="run one part and update its section of existing results (learning = sections 1 and 3)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per latency figure at batch 1 (half at batch 8)")
    parser.add_argument("--recal-batches", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "batchnorm"), help="output path without extension")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python " + shlex.join(["benchmarks/batchnorm.py", *(argv if argv is not None else sys.argv[1:])])
    # Fewer epochs, images or repeats than the committed run: written elsewhere (see _results.py).
    args.out = str(destination(args.out, partial_options(parser, args, ["epochs", "train_size", "test_size",
                                                                         "repeats", "recal_batches"])))
    json_path = Path(f"{args.out}.json")
    results: dict = {}
    if args.only in (None, "learning"):
        start = time.perf_counter()
        train_loader, calib_loader, test_loader = loaders(args)
        training, trained_bn = bench_training(args, train_loader, calib_loader, test_loader)
        print("recalibration after pruning", flush=True)
        recalibration = bench_recalibration(args, trained_bn, calib_loader, test_loader)
        results["learning"] = {"training": training, "recalibration": recalibration,
                               **_run_info(command, args, time.perf_counter() - start)}
    if args.only in (None, "fold"):
        start = time.perf_counter()
        print("fold latency", flush=True)
        rows = bench_fold(args)
        results["fold"] = {"rows": rows, "timing": "unfolded and folded timed in alternating single runs",
                           **_run_info(command, args, time.perf_counter() - start)}
    if args.only and json_path.exists():
        # Read just before writing: the other part may have finished meanwhile.
        results = {**json.loads(json_path.read_text()), **results}
    write_text(json_path, json.dumps(results, indent=2) + "\n")
    write_text(f"{args.out}.md", to_markdown(results))
    print(f"wrote {json_path} and {args.out}.md")


def _run_info(command: str, args, seconds: float) -> dict:
    return {"command": command, "args": vars(args), "seconds": seconds, "torch": torch.__version__,
            "load_average_1min_at_end": os.getloadavg()[0],
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"}


if __name__ == "__main__":
    main()
