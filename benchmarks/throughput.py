"""Training and eval throughput on Fashion-MNIST: data loading, bf16 autocast, channels-last.

Measures images/s of a ResNet-18-style network (``_smallnet.SmallResNet18``) for:

* training with optkit's tuned loader vs the folklore ``num_workers=4`` vs
  ``num_workers=0`` vs batches sliced from tensors preloaded in memory (the
  upper bound where loading costs nothing), plus torchvision-style per-item PIL
  transforms for context;
* training and eval in fp32 vs bf16 autocast, each with channels-last off/on
  (data preloaded, so only compute is measured);
* eval with 1 vs 2 intra-op threads.

Configurations are measured round-robin (every round measures each once) and
the median over rounds is reported, so a change in machine load hits all of
them alike. The first batch of each measurement is untimed (worker start-up
and first-call overheads are excluded for every configuration alike).

Usage::

    flock /tmp/optkit-bench.lock python benchmarks/throughput.py

Writes ``benchmarks/results/throughput.json`` and ``throughput.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import destination, partial_options  # noqa: E402
from _smallnet import SmallResNet18  # noqa: E402

from optkit.passes.precision import autocast as amp  # noqa: E402

import optkit.data as data  # noqa: E402
from optkit.core.files import write_text  # noqa: E402
from optkit.passes.precision.passes import Autocast  # noqa: E402
from optkit.analysis.latency import cpu_model  # noqa: E402

Batches = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]


class PilItems(Dataset):
    """Fashion-MNIST the torchvision way: one PIL image per item, transformed item by item."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        from torchvision import transforms

        self.images, self.labels = images, labels
        self.transform = transforms.Compose([
            transforms.RandomCrop(28, padding=2), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,)),
        ])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i, 0].numpy(), mode="L")), int(self.labels[i])


def preloaded_batches(images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> Batches:
    def batches():
        order = torch.randperm(len(images))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            yield images[index], labels[index]
    return batches


def loader_batches(loader: DataLoader) -> Batches:
    return lambda: iter(loader)


def train_rate(model: nn.Module, batches: Batches, *, steps: int, cap_s: float, dtype: str | None,
               channels_last: bool) -> tuple[float, float]:
    """Images/s over up to ``steps`` training steps (data fetch included) after one untimed step,
    and the share of that time spent waiting for the next batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    iterator = batches()
    images = 0
    start = wait = 0.0
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        fetch = time.perf_counter()
        x, y = next(iterator)
        if step:
            wait += time.perf_counter() - fetch
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step:
            images += len(x)
            if time.perf_counter() - start > cap_s:
                break
    elapsed = time.perf_counter() - start
    del iterator
    return images / elapsed, wait / elapsed


def eval_rate(model: nn.Module, images: torch.Tensor, *, batch_size: int, steps: int, dtype: str | None,
              channels_last: bool) -> float:
    model.eval()
    x = images[:batch_size]
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        model(x)
        start = time.perf_counter()
        for _ in range(steps):
            model(x)
        elapsed = time.perf_counter() - start
    return steps * batch_size / elapsed


def preload(ds: data.TensorImageDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole split transformed once, without augmentation: what a loader that costs nothing would yield."""
    plain = data.TensorImageDataset(ds.images, ds.labels, mean=(0.2860,), std=(0.3530,))
    items = plain.__getitems__(list(range(len(plain))))
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def with_threads(threads: int, fn: Callable[[], float]) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    train = data.load_dataset(args.data, "train")
    val = data.load_dataset(args.data, "val")
    bs = args.batch_size
    train_x, train_y = preload(train)
    val_x, _ = preload(val)

    tuned = data.make_loader(train, bs, shuffle=True, num_workers="auto", drop_last=True)
    loaders = {
        "tuned loader": loader_batches(tuned),
        "num_workers=4 (naive)": loader_batches(DataLoader(train, bs, shuffle=True, num_workers=4, drop_last=True)),
        "num_workers=0": loader_batches(DataLoader(train, bs, shuffle=True, num_workers=0, drop_last=True)),
        "preloaded tensors (upper bound)": preloaded_batches(train_x, train_y, bs),
    }
    pil = PilItems(train.images, train.labels)
    loaders["per-item PIL transforms, num_workers=0"] = loader_batches(DataLoader(pil, bs, shuffle=True, drop_last=True))
    loaders["per-item PIL transforms, num_workers=4"] = loader_batches(
        DataLoader(pil, bs, shuffle=True, num_workers=4, drop_last=True))

    base = SmallResNet18(in_channels=1, num_classes=10, width=args.width)
    preloaded = loaders["preloaded tensors (upper bound)"]
    train_cases: dict[str, Callable[[nn.Module], float]] = {}
    for name, batches in loaders.items():
        train_cases[f"loader: {name}"] = lambda m, b=batches: train_rate(
            m, b, steps=args.steps, cap_s=args.cap_s, dtype=None, channels_last=False)
    for dtype in (None, "bf16"):
        for cl in (False, True):
            if dtype is None and not cl:
                continue  # the same as the preloaded loader case
            train_cases[f"compute: {dtype or 'fp32'}, channels_last={'on' if cl else 'off'}"] = (
                lambda m, d=dtype, c=cl: train_rate(m, preloaded, steps=args.steps, cap_s=args.cap_s, dtype=d,
                                                    channels_last=c))
    eval_cases = {f"{dtype or 'fp32'}, channels_last={'on' if cl else 'off'}": (dtype, cl, args.threads)
                  for dtype in (None, "bf16") for cl in (False, True)}
    other_threads = 2 if args.threads == 1 else 1
    eval_cases[f"fp32, channels_last=off, {other_threads} intra-op threads"] = (None, False, other_threads)

    models = {name: copy.deepcopy(base) for name in train_cases}
    for name in train_cases:
        if "channels_last=on" in name:
            models[name].to(memory_format=torch.channels_last)
    eval_models = {False: copy.deepcopy(base), True: copy.deepcopy(base).to(memory_format=torch.channels_last)}

    train_samples: dict[str, list[float]] = {name: [] for name in train_cases}
    wait_samples: dict[str, list[float]] = {name: [] for name in train_cases}
    eval_samples: dict[str, list[float]] = {name: [] for name in eval_cases}
    load_before = os.getloadavg()
    started = time.perf_counter()
    names = list(train_cases)
    for r in range(args.rounds):
        # Each round starts one configuration later, so none always runs right after worker start-ups.
        for name in names[r % len(names):] + names[:r % len(names)]:
            rate, wait = train_cases[name](models[name])
            train_samples[name].append(rate)
            wait_samples[name].append(wait)
            print(f"round {r + 1}/{args.rounds} train {name}: {rate:.1f} img/s, waiting for data {wait:.1%}",
                  flush=True)
        for name, (dtype, cl, threads) in eval_cases.items():
            # Fewer steps with other thread counts: on a busy CPU extra threads can be very slow.
            steps = args.eval_steps if threads == args.threads else 2
            eval_samples[name].append(with_threads(threads, lambda: eval_rate(
                eval_models[cl], val_x, batch_size=args.eval_batch_size, steps=steps, dtype=dtype, channels_last=cl)))
            print(f"round {r + 1}/{args.rounds} eval {name}: {eval_samples[name][-1]:.1f} img/s", flush=True)
    seconds = time.perf_counter() - started

    auto = Autocast(dtype="auto", input_shape=(args.eval_batch_size, 1, 28, 28)).apply(copy.deepcopy(base))
    return {
        "train": {name: {**_summary(v), "data_wait_share": round(statistics.median(wait_samples[name]), 4)}
                  for name, v in train_samples.items()},
        "paired_ratios": _paired(train_samples),
        "eval": {name: _summary(v) for name, v in eval_samples.items()},
        "tuned_loader": {"num_workers": tuned.optkit_choice.num_workers,
                         "describe": tuned.optkit_choice.describe(),
                         "batches_per_s": {str(k): round(v, 1) for k, v in tuned.optkit_choice.batches_per_s.items()}},
        "autocast_auto": auto.details,
        "measure_seconds": round(seconds, 1),
        "load_average": {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]},
    }


def _paired(samples: dict[str, list[float]]) -> dict:
    """Per-round ratios of configurations measured in the same round (load drifts cancel), and their median."""
    tuned = samples["loader: tuned loader"]
    out = {}
    for other in ("loader: preloaded tensors (upper bound)", "loader: num_workers=4 (naive)"):
        ratios = [a / b for a, b in zip(tuned, samples[other])]
        out[f"tuned / {other.removeprefix('loader: ')}"] = {"median": round(statistics.median(ratios), 3),
                                                             "per_round": [round(v, 3) for v in ratios]}
    return out


def _summary(samples: list[float]) -> dict:
    return {"median": round(statistics.median(samples), 1), "min": round(min(samples), 1),
            "max": round(max(samples), 1), "samples": [round(s, 1) for s in samples]}


def acceptance(results: dict) -> dict:
    train = results["train"]
    tuned = train["loader: tuned loader"]["median"]
    upper = train["loader: preloaded tensors (upper bound)"]["median"]
    naive = train["loader: num_workers=4 (naive)"]["median"]
    paired = results["paired_ratios"]
    bf16_eval = results["eval"]["bf16, channels_last=off"]["median"] / results["eval"]["fp32, channels_last=off"]["median"]
    bf16_train = train["compute: bf16, channels_last=off"]["median"] / upper
    return {
        "tuned_over_preloaded": round(tuned / upper, 3),
        "tuned_over_naive": round(tuned / naive, 3),
        "tuned_at_least_0.95_of_preloaded": tuned >= 0.95 * upper,
        "tuned_not_below_naive": tuned >= naive,
        "paired_tuned_over_preloaded": paired["tuned / preloaded tensors (upper bound)"]["median"],
        "paired_tuned_over_naive": paired["tuned / num_workers=4 (naive)"]["median"],
        "tuned_data_wait_share": train["loader: tuned loader"]["data_wait_share"],
        "bf16_train_speedup": round(bf16_train, 3),
        "bf16_eval_speedup": round(bf16_eval, 3),
        "auto_amp_choice": results["autocast_auto"]["dtype"],
        "auto_amp_agrees_with_benchmark": (results["autocast_auto"]["dtype"] == "bf16")
        == (bf16_eval >= amp.CPU_BF16_MIN_SPEEDUP),
    }


def environment(args: argparse.Namespace) -> dict:
    cpu = cpu_model()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "usable_cores": len(os.sched_getaffinity(0)), "cpu_native_bf16": amp.cpu_has_native_bf16(),
            "intra_op_threads": args.threads, "git_commit": commit,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def markdown(report: dict) -> str:
    env, res, acc, cfg = report["environment"], report["results"], report["acceptance"], report["config"]
    lines = [
        "# Throughput on Fashion-MNIST", "",
        f"Command: `{report['command']}` from the repository root, run under "
        "`flock /tmp/optkit-bench.lock` so no other timing benchmark overlapped it.", "",
        f"Model: ResNet-18-style (4 stages x 2 basic blocks, 3x3 stem, width {cfg['width']}) on 1x28x28; "
        f"batch {cfg['batch_size']} for training, {cfg['eval_batch_size']} for eval; "
        f"{cfg['rounds']} rounds, up to {cfg['steps']} timed steps per configuration per round, "
        "median over rounds (range: min-max over rounds).", "",
        f"Machine: {env['cpu']}, {env['usable_cores']} usable cores, native bf16: {env['cpu_native_bf16']}, "
        f"torch {env['torch']}, {env['intra_op_threads']} intra-op thread(s), commit {env['git_commit']}, "
        f"{env['date_utc']} UTC. Load average before/after: {res['load_average']['before']} / "
        f"{res['load_average']['after']} (the machine is shared, so absolute figures are noisy).", "",
        "## Training throughput (images/s)", "",
        "| configuration | images/s | range | time waiting for data |", "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {s['median']:.1f} | {s['min']:.1f}-{s['max']:.1f} | {s['data_wait_share']:.2%} |"
              for name, s in res["train"].items()]
    lines += ["", "## Eval throughput (images/s, data preloaded)", "",
              "| configuration | images/s | range |", "|---|---:|---:|"]
    lines += [f"| {name} | {s['median']:.1f} | {s['min']:.1f}-{s['max']:.1f} |" for name, s in res["eval"].items()]
    auto = res["autocast_auto"]
    lines += [
        "", "## Tuned loader", "",
        f"`make_loader` chose {res['tuned_loader']['describe']}.", "",
        "## Acceptance", "",
        f"- tuned loader / preloaded upper bound: **{acc['tuned_over_preloaded']}** "
        f"(>= 0.95: {acc['tuned_at_least_0.95_of_preloaded']}); median of per-round ratios "
        f"{acc['paired_tuned_over_preloaded']} {res['paired_ratios']['tuned / preloaded tensors (upper bound)']['per_round']}",
        f"- tuned loader / naive num_workers=4: **{acc['tuned_over_naive']}** (>= 1: {acc['tuned_not_below_naive']}); "
        f"median of per-round ratios {acc['paired_tuned_over_naive']} "
        f"{res['paired_ratios']['tuned / num_workers=4 (naive)']['per_round']}",
        f"- the tuned loader's training steps spent {acc['tuned_data_wait_share']:.2%} of their time waiting for "
        "data" + (": it loads in the training process, so that share is all loading costs it; differences "
                  "between rows beyond it are the shared machine's load changing between measurements"
                  if res["tuned_loader"]["num_workers"] == 0 else " (its workers also take CPU from the step)"),
        f"- bf16 autocast speedup: training {acc['bf16_train_speedup']}x, eval {acc['bf16_eval_speedup']}x",
        f"- `autocast` pass with dtype=auto chose **{auto['dtype']}** ({auto.get('rule')}; its own timing: "
        f"{auto.get('bf16_speedup', 'n/a')}x); agrees with this benchmark's eval speedup "
        f"(threshold {amp.CPU_BF16_MIN_SPEEDUP}x): {acc['auto_amp_agrees_with_benchmark']}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="fashion-mnist", help="dataset spec (default: fashion-mnist)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage (ResNet-18: 64)")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per configuration per round")
    parser.add_argument("--eval-steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cap-s", type=float, default=20.0, help="stop a training measurement after this long")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    # Fewer steps or rounds than the committed run: written elsewhere (see _results.py).
    args.out = str(destination(args.out, partial_options(parser, args, ["steps", "eval_steps", "rounds"])))

    results = run(args)
    report = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/throughput.py", *sys.argv[1:]]),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": environment(args),
        "results": results,
    }
    report["acceptance"] = acceptance(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "throughput.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "throughput.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
