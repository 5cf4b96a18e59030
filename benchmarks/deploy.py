"""CPU deployments (ONNX Runtime FP32/INT8, OpenVINO fp32/bf16/INT8) against the unpruned ONNX Runtime FP32 file.

For each torchvision model (random-init weights: latency does not depend on
their values), unpruned and pruned as ``optkit optimize --prune 0.3`` does
(``StructuredPrune`` with its defaults), every deployment ``--deploy`` tries
is built the way it builds them (ONNX Runtime INT8 by ``quantize_onnx`` with
its op-speed checks, OpenVINO by ``openvino_ir``; INT8 calibrated on random
inputs, so the zoo's INT8 files are for timing only) and all of them are timed
in one interleaved run per thread count and batch
(:func:`optkit.analysis.latency.interleaved_latency`: alternating blocks, one
session alive at a time). Speed-ups are over the unpruned ONNX Runtime FP32
file; what ``--deploy`` would choose from those figures is given by its own
rule (:func:`optkit.passes.deploy.pick`).

The Fashion-MNIST part scores the shipped demo model
(``optkit/demo/fashion_resnet.pt``) on the test split in every deployment,
calibrated on real training images: each precision's accuracy against FP32,
within 0.3 points or not.

Run (timings only mean something when nothing else heavy runs)::

    flock /tmp/optkit-bench.lock python benchmarks/deploy.py

A quick end-to-end check that writes elsewhere::

    python benchmarks/deploy.py --models resnet18 --quick --out /tmp/deploy-check
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
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

from optkit.analysis.latency import Deployment, cpu_model, interleaved_latency  # noqa: E402
from optkit.core.errors import DataError, ExportError  # noqa: E402
from _results import destination, partial_options  # noqa: E402

from optkit.core.files import atomic_path, write_text  # noqa: E402
from optkit.demo import FASHION_RESNET  # noqa: E402
from optkit.export.onnx import export_onnx  # noqa: E402
from optkit.model.stats import count_macs  # noqa: E402
from optkit.passes.deploy import CANDIDATES, CheckSettings, openvino_ir, pick  # noqa: E402
from optkit.passes.deploy.choose import Candidate  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from optkit.passes.quantize import Int8Settings, quantize_onnx  # noqa: E402
from optkit.passes.quantize.calibration import load_batches  # noqa: E402
from optkit.passes.quantize.verify import agreement, outputs  # noqa: E402
from optkit.runtime import openvino as ov  # noqa: E402

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
VARIANTS = ("unpruned", "pruned")
THREADS = (1, 2)
BATCHES = (1, 8)
INPUT_SHAPE = (1, 3, 224, 224)
FASHION_SHAPE = (1, 1, 28, 28)
#: The accuracy a lower precision may lose on the Fashion-MNIST test split (0.3 points).
FASHION_TOLERANCE = 0.003
RESULTS = ROOT / "benchmarks" / "results"
NOTES = [
    "Random-init weights and random calibration: the zoo's INT8 files are for timing; checks of bf16 and INT8 on "
    "random inputs are not enforced there (fp32 is still checked to 1e-3). Accuracy comes from the Fashion-MNIST part.",
    "Every deployment of a model, unpruned and pruned, is timed in one interleaved run per thread count and batch: "
    "alternating blocks of 2 calls, each on a fresh session (an OpenVINO model compiled for the fixed input shape), "
    "one session alive at a time. Speed-up = unpruned ONNX Runtime FP32 ms / deployment ms.",
    "OpenVINO fp32 sets INFERENCE_PRECISION_HINT f32 explicitly; bf16 sets bf16; INT8 (NNCF, default preset) runs "
    "its other ops in bf16 where the CPU has it. ONNX Runtime INT8 is quantize_onnx with its op-speed checks, static "
    "QDQ for every model (as --deploy builds it).",
    "Chosen = what --deploy keeps from these figures: simplest first (ORT FP32, OV fp32, OV bf16, ORT INT8, OV INT8), "
    "a deployment replaces the one kept only when at least --deploy-min-gain faster. Spread = p90 / median, the "
    "timing noise of each figure.",
]


def int8_settings(args) -> Int8Settings:
    return Int8Settings(random_calibration=True, calibration_batches=4, batch_size=4, eval_samples=16,
                        min_agreement=0.0, max_accuracy_drop=1.0, auto_exclude=False, measure_ops=not args.quick)


def check_settings() -> CheckSettings:
    return CheckSettings(random_calibration=True, calibration_batches=4, batch_size=4, eval_samples=16,
                         min_agreement=0.0, max_accuracy_drop=1.0)


def build(model: torch.nn.Module, folder: Path, args) -> dict[str, dict]:
    """Every deployment of ``model`` in ``folder``: ``{name: {"path", "status", ...}}``."""
    folder.mkdir()
    fp32 = folder / "model.onnx"
    export_onnx(model, fp32, INPUT_SHAPE)
    built = {"onnxruntime-fp32": {"path": fp32, "status": "built", "file_size": fp32.stat().st_size}}
    for name in CANDIDATES[1:]:
        runtime, precision = name.split("-")
        start = time.perf_counter()
        try:
            if runtime == "onnxruntime":
                path = folder / "model.int8.onnx"
                result = quantize_onnx(fp32, path, int8_settings(args), input_shape=INPUT_SHAPE)
                size = result.int8_size
            elif (reason := ov.unavailable(precision)) is not None:
                built[name] = {"status": "unavailable", "reason": reason}
                continue
            else:
                path = folder / f"model-{precision}.xml"
                size = openvino_ir(fp32, path, precision, check_settings(), input_shape=INPUT_SHAPE).file_size
        except (ExportError, DataError) as e:
            built[name] = {"status": "refused", "reason": str(e)}
            continue
        built[name] = {"path": path, "status": "built", "file_size": size,
                       "seconds": round(time.perf_counter() - start, 1)}
    return built


def bench_model(name: str, args, scratch: Path) -> dict:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name).eval()
    pruned = StructuredPrune(ratio=args.ratio, input_shape=INPUT_SHAPE)(copy.deepcopy(model)).eval()
    built = {"unpruned": build(model, scratch / f"{name}-unpruned", args),
             "pruned": build(pruned, scratch / f"{name}-pruned", args)}
    macs_ratio = count_macs(pruned, INPUT_SHAPE) / count_macs(model, INPUT_SHAPE)
    entry: dict = {"model": name, "macs_ratio": round(macs_ratio, 4),
                   "builds": {v: {n: {k: val for k, val in b.items() if k != "path"} for n, b in built[v].items()}
                              for v in VARIANTS}, "runs": []}
    timed = [(v, n) for v in VARIANTS for n in CANDIDATES if built[v][n]["status"] == "built"]
    targets = [Deployment(built[v][n]["path"], *n.split("-")) for v, n in timed]
    load_start = os.getloadavg()[0]
    for threads in args.threads:
        for batch in args.batches:
            results = interleaved_latency(targets, (batch, *INPUT_SHAPE[1:]), threads=threads, warmup=args.warmup,
                                          repeats=args.repeats)
            baseline = results[0].median_ms
            run: dict = {"threads": threads, "batch": batch, "baseline_ms": round(baseline, 3)}
            for (variant, name_), result in zip(timed, results):
                run.setdefault(variant, {})[name_] = {"median_ms": round(result.median_ms, 3),
                                                      "spread": round(result.spread, 3),
                                                      "speedup": round(baseline / result.median_ms, 3)}
            for variant in VARIANTS:
                run[variant]["chosen"] = choose(run[variant], args.min_gain)
            entry["runs"].append(run)
    entry["load_avg_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return entry


def choose(figures: dict[str, dict], min_gain: float) -> dict:
    """What ``--deploy`` keeps from these figures, and why it refused the others."""
    candidates = [Candidate(n, *n.split("-"), latency={"median_ms": figures[n]["median_ms"]})
                  for n in CANDIDATES if n in figures]
    chosen = pick(candidates, min_gain)
    return {"name": chosen.name, "speedup": figures[chosen.name]["speedup"],
            "refused": {c.name: c.reason for c in candidates if c.status == "refused"}}


def bench_fashion(args, scratch: Path) -> dict:
    """Test-split accuracy of the demo model in every deployment, calibrated on real training images."""
    from optkit.io import models

    folder = scratch / "fashion"
    folder.mkdir()
    fp32 = folder / "model.onnx"
    export_onnx(models.load(str(FASHION_RESNET)).model.eval(), fp32, FASHION_SHAPE)
    test = load_batches("fashion-mnist", "test", FASHION_SHAPE, batch_size=500, samples=args.fashion_test_size)
    labels = np.concatenate(test.labels)
    reference = outputs(fp32, test)
    checks = {"calib_data": "fashion-mnist", "calibration_batches": 16, "batch_size": 32, "min_agreement": 0.0,
              "max_accuracy_drop": 1.0}
    rows = []
    for name in CANDIDATES:
        runtime, precision = name.split("-")
        if runtime == "openvino" and (reason := ov.unavailable(precision)) is not None:
            rows.append({"deployment": name, "status": "unavailable", "reason": reason})
            continue
        if name == "onnxruntime-fp32":
            actual = reference
        elif runtime == "onnxruntime":
            path = folder / "model.int8.onnx"
            quantize_onnx(fp32, path, Int8Settings(**checks, measure_ops=False), input_shape=FASHION_SHAPE)
            actual = outputs(path, test)
        else:
            path = folder / f"model-{precision}.xml"
            openvino_ir(fp32, path, precision, CheckSettings(**checks), input_shape=FASHION_SHAPE)
            compiled = ov.compile_model(path)
            actual = np.concatenate([ov.run(compiled, x).reshape(len(x), -1) for x in test.inputs])
        found = agreement(reference, actual, labels)
        rows.append({"deployment": name, "status": "ok" if found.accuracy_drop <= FASHION_TOLERANCE else "refused",
                     **found.to_dict()})
    return {"model": FASHION_RESNET.name, "test_samples": int(len(labels)), "rows": rows}


def medians(models: list[dict], threads: int, batch: int) -> dict[str, float]:
    """Median speed-up over the models of each deployment and of the choice, at one thread count and batch."""
    values: dict[str, list[float]] = {}
    for m in models:
        for run in m["runs"]:
            if (run["threads"], run["batch"]) != (threads, batch):
                continue
            for variant in VARIANTS:
                for name, figures in run[variant].items():
                    key = f"{variant} {name}" if name != "chosen" else f"{variant} chosen"
                    values.setdefault(key, []).append(figures["speedup"])
    return {key: round(statistics.median(v), 3) for key, v in values.items()}


def to_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# Deployment: ONNX Runtime and OpenVINO on the CPU", "", f"Command: `{report['command']}`", "",
             f"Measured {report['date']} on {report['machine']}; onnxruntime {cfg['onnxruntime']}, OpenVINO "
             f"{cfg['openvino']}, torch {cfg['torch']}; median of {cfg['repeats']} interleaved calls after "
             f"{cfg['warmup']} warm-up calls per session, input {'x'.join(map(str, INPUT_SHAPE[1:]))}, pruned = "
             f"StructuredPrune ratio {cfg['ratio']}. Speed-up over the unpruned ONNX Runtime FP32 file; (spread).", ""]
    names = list(CANDIDATES)
    lines += ["| model | variant | threads | batch | " + " | ".join(names) + " | chosen |",
              "|---|---|---:|---:|" + "---:|" * len(names) + "---|"]
    for m in report["models"]:
        for run in m["runs"]:
            for variant in VARIANTS:
                figures = run[variant]
                cells = [f"{figures[n]['speedup']:.2f}× ({figures[n]['spread']:.2f})" if n in figures else "–"
                         for n in names]
                chosen = figures["chosen"]
                lines.append(f"| {m['model']} | {variant} | {run['threads']} | {run['batch']} | " + " | ".join(cells)
                             + f" | {chosen['name']} {chosen['speedup']:.2f}× |")
    for threads in cfg["threads"]:
        for batch in cfg["batches"]:
            lines += ["", f"## Median over the models, {threads} thread(s), batch {batch}", ""]
            lines += [f"- {key}: {value:.2f}×" for key, value in medians(report["models"], threads, batch).items()]
    if report.get("fashion"):
        f = report["fashion"]
        lines += ["", f"## Fashion-MNIST test accuracy ({f['model']}, {f['test_samples']:,} images)", "",
                  "| deployment | accuracy | FP32 accuracy | drop (points) | agreement with FP32 | within 0.3 points |",
                  "|---|---:|---:|---:|---:|---|"]
        for r in f["rows"]:
            if r["status"] == "unavailable":
                lines.append(f"| {r['deployment']} | – | – | – | – | unavailable: {r['reason']} |")
                continue
            lines.append(f"| {r['deployment']} | {r['accuracy_int8']:.2%} | {r['accuracy_fp32']:.2%} | "
                         f"{100 * r['accuracy_drop']:+.2f} | {r['agreement']:.2%} | "
                         f"{'yes' if r['status'] == 'ok' else 'no: refused'} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [(t, b) for t in report["config"]["threads"] for b in report["config"]["batches"]]
    fig, axes = plt.subplots(len(VARIANTS), len(settings), figsize=(4.5 * len(settings), 7), squeeze=False,
                             sharey=True)
    names = [m["model"] for m in report["models"]]
    width = 0.8 / len(CANDIDATES)
    for row, variant in enumerate(VARIANTS):
        for ax, (threads, batch) in zip(axes[row], settings):
            for i, deployment in enumerate(CANDIDATES):
                values = [next((r[variant].get(deployment, {}).get("speedup", 0.0) for r in m["runs"]
                                if (r["threads"], r["batch"]) == (threads, batch)), 0.0) for m in report["models"]]
                ax.bar(np.arange(len(names)) + (i - len(CANDIDATES) / 2 + 0.5) * width, values, width, label=deployment)
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
            ax.set_xticks(np.arange(len(names)), names, rotation=35, ha="right", fontsize=8)
            ax.set_title(f"{variant}, {threads} thread(s), batch {batch}", fontsize=9)
        axes[row][0].set_ylabel("speed-up over unpruned ORT FP32")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_results(args, report: dict) -> None:
    out = Path(args.out)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_text(out.with_suffix(".md"), to_markdown(report))
    if report["models"]:
        plot(report, out.with_suffix(".png"))


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision names ('' for none)")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="comma-separated thread counts")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--ratio", type=float, default=0.3, help="StructuredPrune ratio of the pruned variant")
    parser.add_argument("--min-gain", type=float, default=0.02, help="--deploy-min-gain of the choice")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per session")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per deployment and setting")
    parser.add_argument("--fashion-test-size", type=int, default=10000, help="test images of the accuracy part")
    parser.add_argument("--no-fashion", action="store_true", help="skip the Fashion-MNIST accuracy part")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 2 timed calls, 512 test images, "
                                                             "no op-speed checks in ONNX Runtime INT8")
    parser.add_argument("--torch-threads", type=int, default=2, help="torch threads for pruning and export")
    parser.add_argument("--note", action="append", default=[], help="a note about this run for the report")
    parser.add_argument("--out", default=str(RESULTS / "deploy"), help="output path without extension")
    args = parser.parse_args(argv)
    # Fewer models, settings or repeats than the committed run: written elsewhere (see _results.py).
    partial = partial_options(parser, args, ["models", "threads", "batches", "repeats", "warmup",
                                             "fashion_test_size", "no_fashion", "quick"])
    args.out = str(destination(args.out, partial))
    args.threads = [int(t) for t in args.threads.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.warmup, args.repeats, args.fashion_test_size = 1, 2, min(args.fashion_test_size, 512)
    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    report = {
        "command": "flock /tmp/optkit-bench.lock python benchmarks/deploy.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()} ({os.cpu_count()} CPUs; bf16: {ov.available() and ov.cpu_has_bf16()})",
        "load_avg_at_start": [round(v, 2) for v in os.getloadavg()],
        "config": {"threads": args.threads, "batches": args.batches, "ratio": args.ratio, "min_gain": args.min_gain,
                   "warmup": args.warmup, "repeats": args.repeats, "quick": args.quick,
                   "onnxruntime": ort.__version__, "torch": torch.__version__,
                   "openvino": _version("openvino")},
        "models": [], "fashion": None, "notes": NOTES + args.note,
    }
    with tempfile.TemporaryDirectory(prefix="optkit-deploy-") as scratch:
        for name in filter(None, args.models.split(",")):
            report["models"].append(bench_model(name, args, Path(scratch)))
            print(json.dumps(report["models"][-1]), flush=True)
            report["seconds"] = round(time.perf_counter() - started, 1)
            # Written after every model, so an interrupted run keeps what it measured.
            write_results(args, report)
        if not args.no_fashion:
            report["fashion"] = bench_fashion(args, Path(scratch))
            print(json.dumps(report["fashion"]), flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(args, report)


if __name__ == "__main__":
    main()
