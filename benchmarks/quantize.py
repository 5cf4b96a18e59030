"""INT8 quantization in ONNX Runtime on the CPU: latency against FP32 and pruning, and accuracy on Fashion-MNIST.

For each torchvision model (random-init weights: latency does not depend on
their values): the FP32 export, its INT8 model (static QDQ per-channel for CNNs,
dynamic for vit_b_16, whose time is in linear layers), the model structurally
pruned at 0.3 (``StructuredPrune``) exported FP32, and that pruned model in
INT8. The four files are timed with
:func:`optkit.analysis.latency.interleaved_latency` at each batch size and
thread count: alternating blocks of calls, one session alive at a time, with
ONNX Runtime's default spinning thread pool (as a served model runs), so a
change in machine load slows them alike; the 1-minute load average is
recorded at the start and end of each model.

Every INT8 file comes from ``optkit.passes.quantize.quantize_onnx``, which leaves
in FP32 the op groups whose INT8 kernels measure slower on this machine. With
random weights and random calibration the INT8 models are fit for timing only
(their agreement is reported, not enforced). ``--fashion`` adds the accuracy
part: the Fashion-MNIST baseline of ``benchmarks/accuracy.py``
(``optkit/demo/fashion_resnet.pt``) calibrated on real training images,
with FP32 and INT8 accuracy on the 10,000 test images.

Run (timings only mean something when nothing else heavy runs)::

    flock /tmp/optkit-bench.lock python benchmarks/quantize.py --fashion
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torchvision

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import destination, partial_options  # noqa: E402

from optkit.core.files import atomic_path, write_text  # noqa: E402
from optkit.demo import FASHION_RESNET  # noqa: E402
from optkit.export.onnx import export_onnx  # noqa: E402
from optkit.model.stats import count_macs  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from optkit.passes.quantize import Int8Settings, interleaved_latency, quantize_onnx  # noqa: E402
from optkit.passes.quantize.calibration import load_batches  # noqa: E402
from optkit.passes.quantize.verify import agreement, outputs  # noqa: E402

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
DYNAMIC = {"vit_b_16"}
BATCHES = (1, 8)
THREADS = (1, 2)
INPUT_SHAPE = (1, 3, 224, 224)
VARIANTS = ("fp32", "int8", "pruned_fp32", "pruned_int8")
RESULTS = ROOT / "benchmarks" / "results"
FASHION_BASELINE = FASHION_RESNET
FASHION_ARCH = "optkit.demo.fashion_resnet:FashionResNet"
FASHION_SHAPE = (1, 1, 28, 28)
NOTES = [
    "Random-init weights and random calibration inputs: the zoo's INT8 files are for timing; their top-1 agreement "
    "with FP32 on random inputs is listed but not enforced. Accuracy claims come from the Fashion-MNIST part only.",
    "What quantize_onnx kept in FP32 because its INT8 kernels measured slower (timed at 1 thread, batch 1) is listed "
    "per model, for the INT8 and the pruned INT8 file: op groups, then single nodes found by ONNX Runtime's profiler "
    "and confirmed by timing the whole model (their names are in quantize.json).",
    "Speedups are FP32 median / variant median at the same batch and thread count, all four files timed in "
    "alternating blocks (one session alive at a time, spinning thread pools). Runs before 2026-12-03 10:00 UTC kept "
    "all four sessions alive with spinning off, which charged every operator a thread wake-up at 2 threads.",
    "The load average columns are the 1-minute load at the start and end of the model; the benchmark's own threads add "
    "about 1 each, more means something else ran and absolute milliseconds are inflated.",
]


def int8_settings(name: str) -> Int8Settings:
    mode = "dynamic" if name in DYNAMIC else "static"
    return Int8Settings(mode=mode, random_calibration=True, calibration_batches=4, batch_size=4, eval_samples=32,
                        min_agreement=0.0, max_accuracy_drop=1.0, auto_exclude=False)


def bench_model(name: str, args, scratch: Path) -> dict:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name).eval()
    pruned = StructuredPrune(ratio=args.ratio, round_to=args.round_to, input_shape=INPUT_SHAPE)(copy.deepcopy(model))
    paths = {variant: scratch / f"{name}-{variant}.onnx" for variant in VARIANTS}
    export_onnx(model, paths["fp32"], INPUT_SHAPE)
    export_onnx(pruned, paths["pruned_fp32"], INPUT_SHAPE)
    entry: dict = {"model": name, "mode": "dynamic" if name in DYNAMIC else "static",
                   "macs": {"fp32": count_macs(model, INPUT_SHAPE), "pruned": count_macs(pruned, INPUT_SHAPE)}}
    cache = scratch / "op-speed.json"
    for source, target in (("fp32", "int8"), ("pruned_fp32", "pruned_int8")):
        result = quantize_onnx(paths[source], paths[target], int8_settings(name), input_shape=INPUT_SHAPE,
                               cache_path=cache)
        entry[target] = {"fp32_op_types": result.fp32_op_types, "fp32_nodes": result.fp32_nodes,
                         "op_gains": result.op_gains,
                         "agreement_random_inputs": round(result.agreement, 4),
                         "relative_error": round(result.relative_error, 4), "seconds": result.seconds}
    entry["file_size"] = {variant: path.stat().st_size for variant, path in paths.items()}
    load_start = os.getloadavg()[0]
    entry["runs"] = []
    for threads in args.threads:
        for batch in args.batches:
            timings = interleaved_latency([paths[v] for v in VARIANTS], (batch, *INPUT_SHAPE[1:]), threads=threads,
                                          warmup=args.warmup, repeats=args.repeats)
            run = {"batch": batch, "threads": threads}
            for variant, timing in zip(VARIANTS, timings):
                run[variant] = {"median_ms": round(timing.median_ms, 3), "min_ms": round(timing.min_ms, 3),
                                "spread": round(timing.spread, 3)}
            for variant in VARIANTS[1:]:
                run[variant]["speedup"] = round(run["fp32"]["median_ms"] / run[variant]["median_ms"], 3)
            entry["runs"].append(run)
    entry["load_avg_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return entry


def bench_fashion(args, scratch: Path) -> dict:
    """FP32 vs INT8 accuracy of the trained Fashion-MNIST baseline, per calibration method, on the test split."""
    from optkit.io import models

    loaded = models.load(FASHION_BASELINE, arch=FASHION_ARCH)
    fp32_path = scratch / "fashion-fp32.onnx"
    export_onnx(loaded.model, fp32_path, FASHION_SHAPE)
    test = load_batches("fashion-mnist", "test", FASHION_SHAPE, batch_size=500, samples=args.fashion_test_size)
    labels = np.concatenate(test.labels)
    reference = outputs(fp32_path, test)
    rows = []
    for method in args.methods:
        path = scratch / f"fashion-int8-{method}.onnx"
        settings = Int8Settings(calib_data="fashion-mnist", calibration_method=method, calibration_batches=16,
                                batch_size=32, measure_ops=False)
        result = quantize_onnx(fp32_path, path, settings, input_shape=FASHION_SHAPE)
        on_test = agreement(reference, outputs(path, test), labels)
        rows.append({"method": method, "excluded_nodes": result.excluded_nodes, "check_on_val": {
            "agreement": result.agreement, "accuracy_fp32": result.accuracy_fp32,
            "accuracy_int8": result.accuracy_int8, "samples": result.samples},
            "test": on_test.to_dict(), "file_size": {"fp32": result.fp32_size, "int8": result.int8_size}})
    pruned = pruned_finetuned(loaded.model, args, scratch, test, labels)
    return {"baseline": FASHION_BASELINE.name, "test_samples": int(len(labels)), "rows": rows, "pruned": pruned}


def pruned_finetuned(model, args, scratch: Path, test, labels) -> dict:
    """Prune the baseline to half its MACs, recalibrate BatchNorm, fine-tune 2 epochs, then quantize (minmax)."""
    from optkit.core.pipeline import Pipeline
    from optkit.passes.batchnorm import RecalibrateBatchNorm
    from optkit.passes.finetune import FineTune

    start = time.perf_counter()
    passes = [StructuredPrune(target_macs=0.5, round_to=2), RecalibrateBatchNorm(data="fashion-mnist", batches=20),
              FineTune(data="fashion-mnist", epochs=args.fashion_epochs, amp="bf16", device="cpu", num_workers=0)]
    run = Pipeline(passes, input_shape=FASHION_SHAPE).run(copy.deepcopy(model))
    fp32_path, int8_path = scratch / "fashion-pruned-fp32.onnx", scratch / "fashion-pruned-int8.onnx"
    export_onnx(run.model, fp32_path, FASHION_SHAPE)
    settings = Int8Settings(calib_data="fashion-mnist", calibration_batches=16, batch_size=32, measure_ops=False)
    result = quantize_onnx(fp32_path, int8_path, settings, input_shape=FASHION_SHAPE)
    on_test = agreement(outputs(fp32_path, test), outputs(int8_path, test), labels)
    return {"macs_ratio": run.after.macs / run.before.macs, "epochs": args.fashion_epochs,
            "seconds": round(time.perf_counter() - start, 1), "excluded_nodes": result.excluded_nodes,
            "test": on_test.to_dict(), "file_size": {"fp32": result.fp32_size, "int8": result.int8_size}}


def to_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# INT8 quantization: ONNX Runtime CPU latency and accuracy", "", f"Command: `{report['command']}`", "",
             f"Measured {report['date']} on {report['machine']}; onnxruntime {cfg['onnxruntime']}, torch "
             f"{cfg['torch']}, median of {cfg['repeats']} interleaved runs after {cfg['warmup']} warm-up runs, input "
             f"{'x'.join(map(str, INPUT_SHAPE[1:]))}, StructuredPrune ratio {cfg['ratio']} (round_to "
             f"{cfg['round_to']}). Speedup = FP32 ms / variant ms.", ""]
    if report["models"]:
        lines += ["| model | mode | batch | threads | FP32 ms | INT8 ms (×) | pruned FP32 ms (×) | pruned INT8 ms (×) "
                  "| kept FP32 (INT8; pruned INT8) | load avg (start, end) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for m in report["models"]:
            kept = "; ".join(_kept_fp32(m[v]) for v in ("int8", "pruned_int8"))
            for run in m["runs"]:
                cells = [m["model"], m["mode"], str(run["batch"]), str(run["threads"]), f"{run['fp32']['median_ms']:.1f}"]
                cells += [f"{run[v]['median_ms']:.1f} ({run[v]['speedup']:.2f}×)" for v in VARIANTS[1:]]
                cells += [kept, ", ".join(map(str, m["load_avg_1min"]))]
                lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "## Median over the models, batch 1", "", "| threads | INT8 | pruned FP32 | pruned INT8 |",
                  "|---:|---:|---:|---:|"]
        for threads, medians in _medians(report["models"], batch=1).items():
            lines.append(f"| {threads} | " + " | ".join(f"{medians[v]:.2f}×" for v in VARIANTS[1:]) + " |")
    if report.get("fashion"):
        f = report["fashion"]
        lines += ["", f"## Fashion-MNIST accuracy ({f['baseline']}, {f['test_samples']:,} test images)", "",
                  "| calibration | FP32 accuracy | INT8 accuracy | drop (points) | top-1 agreement | relative error "
                  "| layers left FP32 | size FP32 → INT8 |", "|---|---:|---:|---:|---:|---:|---|---|"]
        for r in f["rows"]:
            t = r["test"]
            lines.append(f"| {r['method']} | {t['accuracy_fp32']:.2%} | {t['accuracy_int8']:.2%} "
                         f"| {100 * t['accuracy_drop']:+.2f} | {t['agreement']:.2%} | {t['relative_error']:.4f} "
                         f"| {', '.join(r['excluded_nodes']) or 'none'} "
                         f"| {r['file_size']['fp32']:,} → {r['file_size']['int8']:,} B |")
    if report.get("fashion") and report["fashion"].get("pruned"):
        f = report["fashion"]
        base = f["rows"][0]["test"]["accuracy_fp32"]
        pr = f["pruned"]
        t = pr["test"]
        lines += ["", f"Pruned to {pr['macs_ratio']:.3f}× the MACs (target_macs 0.5, round_to 2), BatchNorm "
                  f"recalibrated, fine-tuned {pr['epochs']} epochs ({pr['seconds']:.0f} s), then INT8 (minmax):", "",
                  "| model | test accuracy | against the unpruned FP32 baseline (points) |", "|---|---:|---:|",
                  f"| unpruned FP32 | {base:.2%} | |",
                  f"| pruned + fine-tuned FP32 | {t['accuracy_fp32']:.2%} | {100 * (t['accuracy_fp32'] - base):+.2f} |",
                  f"| pruned + fine-tuned INT8 | {t['accuracy_int8']:.2%} | {100 * (t['accuracy_int8'] - base):+.2f} |"]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _kept_fp32(entry: dict) -> str:
    """Op groups and the count of single nodes a quantize_onnx run left in FP32 for speed."""
    words = list(entry["fp32_op_types"])
    if entry.get("fp32_nodes"):
        words.append(f"{len(entry['fp32_nodes'])} node(s)")
    return ", ".join(words) or "none"


def _medians(models: list[dict], batch: int) -> dict[int, dict[str, float]]:
    """``{threads: {variant: median speed-up over FP32}}`` over the models at one batch size."""
    runs: dict[int, dict[str, list[float]]] = {}
    for m in models:
        for run in m["runs"]:
            if run["batch"] == batch:
                for v in VARIANTS[1:]:
                    runs.setdefault(run["threads"], {}).setdefault(v, []).append(run[v]["speedup"])
    return {t: {v: float(np.median(values)) for v, values in per.items()} for t, per in sorted(runs.items())}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["batch"], r["threads"]) for m in report["models"] for r in m["runs"]})
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 4), squeeze=False, sharey=True)
    names = [m["model"] for m in report["models"]]
    for ax, (batch, threads) in zip(axes[0], runs):
        for i, variant in enumerate(VARIANTS[1:]):
            values = [next(r[variant]["speedup"] for r in m["runs"] if (r["batch"], r["threads"]) == (batch, threads))
                      for m in report["models"]]
            ax.bar(np.arange(len(names)) + (i - 1) * 0.27, values, 0.27, label=variant.replace("_", " "))
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(np.arange(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"batch {batch}, {threads} thread(s)")
    axes[0][0].set_ylabel("speedup over FP32 (ONNX Runtime CPU)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def write_results(args, report: dict) -> None:
    out = Path(args.out)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_text(out.with_suffix(".md"), to_markdown(report))
    if report["models"]:
        plot(report, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision names ('' for none)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="comma-separated intra-op threads")
    parser.add_argument("--ratio", type=float, default=0.3, help="StructuredPrune ratio of the pruned variants")
    parser.add_argument("--round-to", type=int, default=16, help="StructuredPrune round_to")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--fashion", action="store_true", help="add the Fashion-MNIST accuracy part")
    parser.add_argument("--methods", default="minmax,entropy,percentile", help="calibration methods (--fashion)")
    parser.add_argument("--fashion-test-size", type=int, default=10000, help="test images for --fashion")
    parser.add_argument("--fashion-epochs", type=int, default=2, help="fine-tune epochs of the pruned model (--fashion)")
    parser.add_argument("--torch-threads", type=int, default=2, help="torch threads for pruning and export")
    parser.add_argument("--note", action="append", default=[], help="a note about this run for the report")
    parser.add_argument("--out", default=str(RESULTS / "quantize"), help="output path without extension")
    args = parser.parse_args(argv)
    # Fewer models, settings or repeats than the committed run: written elsewhere (see _results.py).
    partial = partial_options(parser, args, ["models", "batches", "threads", "repeats", "warmup", "methods",
                                             "fashion_test_size", "fashion_epochs"])
    args.out = str(destination(args.out, partial))
    args.batches = [int(b) for b in args.batches.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    args.methods = args.methods.split(",")
    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    report = {
        "command": "flock /tmp/optkit-bench.lock python benchmarks/quantize.py "
                   + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".replace("  ", " "),
        "load_avg_at_start": [round(v, 2) for v in os.getloadavg()],
        "config": {"batches": args.batches, "threads": args.threads, "ratio": args.ratio, "round_to": args.round_to,
                   "warmup": args.warmup, "repeats": args.repeats, "onnxruntime": ort.__version__,
                   "torch": torch.__version__},
        "models": [], "fashion": None, "notes": NOTES + args.note,
    }
    with tempfile.TemporaryDirectory(prefix="optkit-quantize-") as scratch:
        for name in filter(None, args.models.split(",")):
            report["models"].append(bench_model(name, args, Path(scratch)))
            print(json.dumps(report["models"][-1]), flush=True)
            report["seconds"] = round(time.perf_counter() - started, 1)
            # Written after every model, so an interrupted run keeps what it measured.
            write_results(args, report)
        if args.fashion:
            report["fashion"] = bench_fashion(args, Path(scratch))
            print(json.dumps(report["fashion"]), flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(args, report)


if __name__ == "__main__":
    main()
