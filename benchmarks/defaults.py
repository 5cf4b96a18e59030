"""Which `optkit optimize` defaults keep the most accuracy at half the MACs (issue #31, "defaults by measurement").

Trains three Fashion-MNIST classifiers that optkit's demo is not
(``benchmarks/_fashion_models.py``: a plain VGG, a bottleneck ResNet, a
MobileNetV2-style net), then runs ``optkit optimize`` on each as a user
does, with the documented flags ``--target-macs 0.5 --finetune fashion-mnist
--epochs 2`` and alternatives one factor at a time: distillation, sensitivity
allocation, BatchNorm recalibration, bias correction, iterative steps,
the learning rate (and a second seed, to show the noise).
The settings that gain on average are then run together. Every result's
``model.pt`` is reloaded with ``optkit.load_model`` and scored here on the
full 10k test split, independently of optkit's own report.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/defaults.py

Writes ``benchmarks/results/defaults.{json,md}`` after every run (an
interrupted run keeps what it measured). Trained models, optimize outputs and
logs go to ``runs/defaults-bench/``; a rerun reuses the trained models unless
``--retrain`` is given, and with ``--reuse-runs`` also the optimize runs whose
record is there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optkit  # noqa: E402
from optkit.core.files import write_text  # noqa: E402
from optkit.data.datasets import load_dataset  # noqa: E402
from _results import destination, partial_options  # noqa: E402

from optkit.io.architectures import ArchSpec  # noqa: E402
from optkit.model.stats import measure  # noqa: E402
from optkit.passes.finetune.loop import fit  # noqa: E402
from optkit.passes.finetune.passes import FineTune  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / "runs" / "defaults-bench"
DATA = "fashion-mnist"
INPUT_SHAPE = (1, 1, 28, 28)
TARGET_MACS = 0.5
#: The documented way, apart from how the prune is asked (see :func:`optimize_args`).
FINETUNE_FLAGS = ("--finetune", DATA, "--epochs", "2")
#: structured_prune settings that have their own flag; the others need the ``--pass`` form.
PRUNE_FLAGS = {"allocation": "--allocation", "iterative_steps": "--iterative-steps"}

MODELS = {
    "vgg": "benchmarks._fashion_models:PlainVGG",
    "bottleneck-resnet": "benchmarks._fashion_models:BottleneckResNet",
    "mobilenet": "benchmarks._fashion_models:MobileNetLike",
}


@dataclass(frozen=True)
class Variant:
    """One way of running optimize: what it changes from the documented flags.

    Attributes:
        name: row label (also the output folder's name).
        factor: what it varies (variants of one factor are compared with each other).
        setting: the value it gives that factor.
        prune: structured_prune settings besides ``target_macs``.
        flags: other flags added to the documented ones.
        data: also give ``--calib-data fashion-mnist`` (sensitivity allocation and recalibration read it).
    """

    name: str
    factor: str
    setting: str
    prune: dict[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    data: bool = False


DEFAULT = Variant("default", "default", "the documented flags")
#: The default of each factor, as the rows call it.
FACTOR_DEFAULTS = {"distillation": "off", "allocation": "uniform", "learning rate": "3e-3",
                   "BN recalibration": "off", "bias correction": "on", "iterative steps": "1",
                   "seed": "0"}
VARIANTS = (
    DEFAULT,
    Variant("distill", "distillation", "on", flags=("--distill",)),
    Variant("sensitivity", "allocation", "sensitivity", prune={"allocation": "sensitivity"}, data=True),
    Variant("recalibrate-bn 20", "BN recalibration", "20 batches", flags=("--recalibrate-bn", "20"), data=True),
    Variant("lr 1e-3", "learning rate", "1e-3", flags=("--lr", "1e-3")),
    Variant("no bias correction", "bias correction", "off", prune={"bias_correction": False}),
    Variant("iterative-steps 3", "iterative steps", "3", prune={"iterative_steps": 3}),
    Variant("lr 1e-2", "learning rate", "1e-2", flags=("--lr", "1e-2")),
    Variant("seed 1", "seed", "1", flags=("--seed", "1")),
)
#: Factors never chosen for the combination: the seed only measures the noise.
NOT_CHOSEN = {"default", "seed"}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def optimize_args(variant: Variant) -> list[str]:
    """The ``optkit optimize`` flags of ``variant`` (without the model, ``--arch`` and ``--out``).

    A structured_prune setting without a flag of its own (``bias_correction``)
    makes the whole prune step a ``--pass structured_prune:...`` entry.
    """
    prune = {"target_macs": TARGET_MACS, **variant.prune}
    if all(key in PRUNE_FLAGS or key == "target_macs" for key in prune):
        args = ["--target-macs", str(TARGET_MACS)]
        for key, value in variant.prune.items():
            args += [PRUNE_FLAGS[key], str(value)]
    else:
        if variant.data:
            prune["data"] = DATA
        args = ["--pass", "structured_prune:" + ",".join(f"{k}={_toml(v)}" for k, v in prune.items())]
    args += [*FINETUNE_FLAGS, *variant.flags]
    if variant.data:
        args += ["--calib-data", DATA]
    return args


def combine(variants: list[Variant]) -> Variant:
    """One variant with the settings of all of ``variants`` (one per factor)."""
    prune: dict[str, Any] = {}
    flags: list[str] = []
    for v in variants:
        prune.update(v.prune)
        flags += v.flags
    label = " + ".join(v.name for v in variants) or DEFAULT.name
    return Variant("combined", "combined", label, prune=prune, flags=tuple(flags), data=any(v.data for v in variants))


@torch.no_grad()
def test_accuracy(model: nn.Module, test_set) -> float:
    """Top-1 accuracy on the whole test split, with a plain loop (independent of optkit's evaluation)."""
    model.eval()
    correct = 0
    for images, labels in DataLoader(test_set, batch_size=1000):
        correct += (model(images).argmax(1) == labels).sum().item()
    return correct / len(test_set)


def trained_model(key: str, spec: str, args, test_set) -> tuple[Path, dict]:
    """Train ``spec`` on Fashion-MNIST (or reuse the cached state_dict) and describe it."""
    folder = CACHE / key
    weights, info_file = folder / "original.pt", folder / "original.json"
    model = ArchSpec(spec, {}).build()
    if weights.exists() and info_file.exists() and not args.retrain:
        model.load_state_dict(torch.load(weights, weights_only=True))
        training = json.loads(info_file.read_text())
    else:
        torch.manual_seed(args.seed)
        model = ArchSpec(spec, {}).build()
        settings = FineTune(data=DATA, epochs=args.train_epochs, batch_size=128, lr=args.train_lr,
                            weight_decay=0.05, warmup=0.03, amp="off", seed=args.seed, device="cpu", num_workers=0)
        start = time.perf_counter()
        result = fit(model, load_dataset(DATA, "train"), load_dataset(DATA, "val"), settings, keep_sparsity=False)
        model = result.model
        training = {"epochs": args.train_epochs, "lr": args.train_lr, "seconds": round(time.perf_counter() - start, 1),
                    "best_epoch": result.best_epoch, "val_accuracy": result.best_accuracy, "history": result.history}
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), weights)
        write_text(info_file, json.dumps(training, indent=2) + "\n")
    stats = measure(model, INPUT_SHAPE)
    info = {"arch": spec, "file": str(weights.relative_to(ROOT)), "params": stats.params, "macs": stats.macs,
            "test_accuracy": test_accuracy(model, test_set), "training": training}
    print(f"{key}: {info['params']:,} params, {info['macs']:,} MACs, test {info['test_accuracy']:.2%}", flush=True)
    return weights, info


def run_variant(key: str, weights: Path, base: dict, variant: Variant, test_set, args) -> dict:
    """Run ``optkit optimize`` for ``variant`` on one model, then reload and score what it wrote."""
    slug = variant.name.replace(" ", "-")
    out = CACHE / key / slug
    record_file = CACHE / key / f"{slug}.run.json"
    argv = ["optimize", str(weights.relative_to(ROOT)), "--arch", base["arch"], *optimize_args(variant),
            "--out", str(out.relative_to(ROOT)), "--force"]
    command = "optkit " + shlex.join(argv)
    if args.reuse_runs and record_file.exists() and json.loads(record_file.read_text())["command"] == command:
        return json.loads(record_file.read_text())
    # A private cache, so the sensitivity analysis is timed cold in every run that asks for it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OPTKIT_CACHE_DIR": tempfile.mkdtemp(prefix="optkit-defaults-cache-"), "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    with open(CACHE / key / f"{slug}.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "optkit", *argv], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    row: dict[str, Any] = {"model": key, "variant": variant.name, "factor": variant.factor,
                           "setting": variant.setting, "flags": shlex.join(optimize_args(variant)), "command": command,
                           "wall_seconds": round(time.perf_counter() - start, 1), "returncode": done.returncode}
    if done.returncode == 0:
        report = json.loads((out / "report.json").read_text())
        row["pass_seconds"] = {p["name"]: round(p["seconds"], 1) for p in report["passes"]}
        model = optkit.load_model(str(out / "model.pt"), arch=base["arch"])
        stats = measure(model, INPUT_SHAPE)
        accuracy = test_accuracy(model, test_set)
        row.update(params=stats.params, macs=stats.macs, macs_ratio=round(stats.macs / base["macs"], 4),
                   test_accuracy=accuracy, loss_points=round(100 * (base["test_accuracy"] - accuracy), 2),
                   val_accuracy=_val_accuracy(report))
    else:
        row["error"] = (CACHE / key / f"{slug}.log").read_text().strip().splitlines()[-1:]
    write_text(record_file, json.dumps(row, indent=2) + "\n")
    return row


def _val_accuracy(report: dict) -> float | None:
    finetunes = [p for p in report["passes"] if p["name"] == "finetune"]
    return finetunes[-1]["details"].get("val_accuracy") if finetunes else None


def factor_summary(report: dict) -> list[dict]:
    """Per factor and setting: mean loss, gain and wall-time ratio against the default, over the models."""
    rows = [r for r in report["runs"] if "test_accuracy" in r]
    default = {r["model"]: r for r in rows if r["variant"] == DEFAULT.name}
    summary = []
    for variant in VARIANTS[1:]:
        mine = [r for r in rows if r["variant"] == variant.name and r["model"] in default]
        if not mine:
            continue
        summary.append({
            "factor": variant.factor, "variant": variant.name, "setting": variant.setting,
            "default_setting": FACTOR_DEFAULTS[variant.factor], "models": len(mine),
            "mean_loss_points": round(mean(r["loss_points"] for r in mine), 3),
            "mean_gain_points": round(mean(default[r["model"]]["loss_points"] - r["loss_points"] for r in mine), 3),
            "time_ratio": round(mean(r["wall_seconds"] / default[r["model"]]["wall_seconds"] for r in mine), 2),
        })
    return summary


def choose(summary: list[dict], min_gain: float, max_time_ratio: float) -> list[Variant]:
    """Per factor, the setting with the largest mean gain, when it gains at least ``min_gain`` within the time limit."""
    by_name = {v.name: v for v in VARIANTS}
    chosen = []
    for factor in dict.fromkeys(s["factor"] for s in summary):
        if factor in NOT_CHOSEN:
            continue
        best = max((s for s in summary if s["factor"] == factor), key=lambda s: s["mean_gain_points"])
        if best["mean_gain_points"] >= min_gain and best["time_ratio"] <= max_time_ratio:
            chosen.append(by_name[best["variant"]])
    return chosen


def write_results(report: dict, partial: list[str] | None = None) -> None:
    """Write defaults.{json,md} to benchmarks/results/, or elsewhere for a partial run (see ``_results.py``)."""
    folder = destination(RESULTS, partial or [])
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "defaults.json", json.dumps(report, indent=2) + "\n")
    write_text(folder / "defaults.md", to_markdown(report))


def to_markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Defaults by measurement: `optkit optimize --target-macs 0.5 --finetune fashion-mnist --epochs 2`", "",
        f"Reproduce: `{report['command']}`", "",
        "Each model below was trained here on Fashion-MNIST (AdamW, cosine schedule; the weights of the best "
        "epoch on the validation split) and saved as a "
        "state_dict. Every row runs `optkit optimize` as a user does (the row's command, in a subprocess); "
        "the `model.pt` it writes is reloaded with `optkit.load_model` and scored by this script on the full "
        f"{s['test_samples']:,}-image test split, apart from optkit's report. Loss is the original's test "
        "accuracy minus the result's, in points (lower is better); Δ is the gain over the default row "
        "(positive is better). Each row changes one thing from the default; `combined` runs the settings "
        "chosen below together.", "",
        f"Wall times include starting Python and loading the model, and were taken on a shared, loaded "
        f"{report['machine']['cpus']}-core machine while others ran their work: treat them as rough "
        "(ratios within a model are more telling than seconds).", "",
    ]
    lines += _recommendation(report)
    for key, base in report["models"].items():
        lines += ["", f"## {key} (`{base['arch']}`)", "",
                  f"{base['params']:,} params, {base['macs']:,} MACs, test accuracy **{base['test_accuracy']:.2%}** "
                  f"(trained {base['training']['epochs']} epochs at lr {base['training']['lr']} in "
                  f"{base['training']['seconds']:.0f} s, best validation epoch {base['training']['best_epoch']}).", "",
                  "| variant | factor: setting | MACs ratio | params | test accuracy | loss (pt) | Δ vs default (pt) "
                  "| wall s | prune s | fine-tune s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        runs = [r for r in report["runs"] if r["model"] == key]
        default = next((r for r in runs if r["variant"] == DEFAULT.name and "test_accuracy" in r), None)
        for r in runs:
            if "test_accuracy" not in r:
                lines.append(f"| {r['variant']} | {r['factor']}: {r['setting']} | failed: "
                             f"{' '.join(r.get('error', []))} | | | | | {r['wall_seconds']:.0f} | | |")
                continue
            delta = "" if default is None else f"{default['loss_points'] - r['loss_points']:+.2f}"
            seconds = r["pass_seconds"]
            prune = sum(v for k, v in seconds.items() if k not in ("finetune",))
            lines.append(f"| {r['variant']} | {r['factor']}: {r['setting']} | {r['macs_ratio']:.3f} | "
                         f"{r['params']:,} | {r['test_accuracy']:.2%} | {r['loss_points']:.2f} | {delta} | "
                         f"{r['wall_seconds']:.0f} | {prune:.0f} | {seconds.get('finetune', 0):.0f} |")
    lines += ["", "## Commands", "", "Each row's exact command (run from the repository root with "
              "`PYTHONPATH=.`, so that `--arch benchmarks._fashion_models:...` imports):", ""]
    lines += [f"- {r['model']}, {r['variant']}: `{r['command']}`" for r in report["runs"]]
    lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _recommendation(report: dict) -> list[str]:
    summary = report.get("summary", [])
    if not summary:
        return []
    s = report["settings"]
    lines = ["## Summary", "",
             f"Mean over the {len(report['models'])} models of each setting's loss and gain over the default, "
             "and its wall time over the default's. A setting is chosen for the combination when it is its "
             f"factor's best, gains at least {s['min_gain']} points on average and takes at most "
             f"{s['max_time_ratio']}× the default's time.", "",
             "| factor | default | setting | mean loss (pt) | mean gain (pt) | time vs default | chosen |",
             "|---|---|---|---:|---:|---:|---|"]
    chosen = set(report.get("chosen", []))
    for row in summary:
        lines.append(f"| {row['factor']} | {row['default_setting']} | {row['setting']} | {row['mean_loss_points']:.2f} "
                     f"| {row['mean_gain_points']:+.2f} | {row['time_ratio']:.2f}× | "
                     f"{'yes' if row['variant'] in chosen else ''} |")
    default = [r for r in report["runs"] if r["variant"] == DEFAULT.name and "loss_points" in r]
    seed = {r["model"]: r for r in report["runs"] if r["variant"] == "seed 1" and "loss_points" in r}
    if default and seed:
        gaps = [abs(r["loss_points"] - seed[r["model"]]["loss_points"]) for r in default if r["model"] in seed]
        lines += ["", f"Noise: the default run with `--seed 1` instead of 0 differs by "
                      f"{', '.join(f'{g:.2f}' for g in gaps)} points on the {len(gaps)} models (mean "
                      f"{mean(gaps):.2f}); single-run gains smaller than that are not telling."]
    combined = [r for r in report["runs"] if r["variant"] == "combined" and "loss_points" in r]
    if combined:
        lines += ["", f"Recommended default set (the chosen settings together: {combined[0]['setting']}): "
                      f"`optkit optimize MODEL {combined[0]['flags']}`; "
                      + "; ".join(f"{r['model']} loses {r['loss_points']:.2f} points "
                                  f"(default {_loss(report, r['model'])}) in {r['wall_seconds']:.0f} s"
                                  for r in combined) + "."]
    return lines


def _loss(report: dict, model: str) -> str:
    row = next((r for r in report["runs"] if r["model"] == model and r["variant"] == DEFAULT.name), {})
    return f"{row['loss_points']:.2f}" if "loss_points" in row else "not measured"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda v: v.split(","), default=list(MODELS),
                        help=f"models to measure, comma-separated (of {', '.join(MODELS)})")
    parser.add_argument("--variants", type=lambda v: v.split(","), default=[v.name for v in VARIANTS],
                        help="variants to run, comma-separated (the default is always run)")
    parser.add_argument("--train-epochs", type=int, default=3, help="epochs of training for each model")
    parser.add_argument("--train-lr", type=float, default=3e-3, help="peak learning rate of that training")
    parser.add_argument("--min-gain", type=float, default=0.05,
                        help="mean gain in points a setting needs to join the combination")
    parser.add_argument("--max-time-ratio", type=float, default=3.0,
                        help="most wall time, over the default's, a setting may take to join the combination")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads here and in each optimize run (on an oversubscribed machine, more "
                             "threads than free cores spend their time waiting for each other)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models' training")
    parser.add_argument("--retrain", action="store_true", help="train the models even if they are cached")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="reuse optimize runs recorded under runs/defaults-bench/ with the same command")
    parser.add_argument("--no-combined", action="store_true", help="skip the run of the chosen settings together")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unknown = set(args.variants) - {v.name for v in VARIANTS} | set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model or variant: {', '.join(sorted(unknown))}")
    # Fewer models or variants than the committed table: a partial run, written elsewhere.
    partial = partial_options(parser, args, ["models", "variants", "train_epochs", "no_combined"])

    started = time.perf_counter()
    test_set = load_dataset(DATA, "test")
    report: dict[str, Any] = {
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/defaults.py " + shlex.join(sys.argv[1:]),
        "settings": {"target_macs": TARGET_MACS, "documented_flags": ["--target-macs", str(TARGET_MACS),
                                                                      *FINETUNE_FLAGS],
                     "train_epochs": args.train_epochs, "train_lr": args.train_lr, "seed": args.seed,
                     "test_samples": len(test_set), "min_gain": args.min_gain, "threads": args.threads,
                     "max_time_ratio": args.max_time_ratio},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine()},
        "models": {}, "runs": [],
        "notes": [
            "Wall times were taken on a shared 2-core machine loaded by other work at the same time (load average "
            "6-11); they are rough, and differences under about 20% are not telling. Every optimize run had one "
            "torch thread (OMP_NUM_THREADS=1, the script's --threads): under that load two threads spent most of "
            "their CPU time waiting for each other (a 30-step training try took 0.9 CPU s a step with two threads, "
            "0.1 with one).",
            "One run per row (seed 0). The `seed 1` row repeats the default with another seed to show how much "
            "a single run moves by chance.",
            "Factors are varied one at a time from the documented flags; the combination is chosen from those "
            "single-factor gains, so interactions (e.g. the best learning rate with distillation) are not "
            "searched.",
            "`--iterative-steps 3` with `--target-macs` prunes in three steps inside one structured_prune and "
            "fine-tunes once at the end (the recipe shows one prune and one finetune step), although `--help` "
            "says it fine-tunes after each step when the command line fine-tunes.",
            "Bias correction has no flag of its own: its row turns it off with "
            "`--pass structured_prune:target_macs=0.5,bias_correction=false`.",
            "The sensitivity rows start from an empty optkit cache, so their time includes the whole analysis.",
        ],
    }
    models = {}
    for key in args.models:
        models[key], report["models"][key] = trained_model(key, MODELS[key], args, test_set)
    variants = [v for v in VARIANTS if v.name in args.variants or v is DEFAULT]
    for variant in variants:
        for key in args.models:
            row = run_variant(key, models[key], report["models"][key], variant, test_set, args)
            print(f"{key} / {variant.name}: {row.get('test_accuracy', 'failed')} loss {row.get('loss_points')} "
                  f"in {row['wall_seconds']} s", flush=True)
            report["runs"].append(row)
            report["summary"] = factor_summary(report)
            report["seconds"] = round(time.perf_counter() - started, 1)
            write_results(report, partial)
    chosen = choose(report["summary"], args.min_gain, args.max_time_ratio)
    report["chosen"] = [v.name for v in chosen]
    if chosen and not args.no_combined:
        combined = combine(chosen)
        for key in args.models:
            report["runs"].append(run_variant(key, models[key], report["models"][key], combined, test_set, args))
            report["seconds"] = round(time.perf_counter() - started, 1)
            write_results(report, partial)
    write_results(report, partial)


if __name__ == "__main__":
    main()
