"""Measured ONNX Runtime CPU speedup of structured pruning, against the MACs it removes.

For each model and structured pruning ratio: the MACs ratio (after / before),
ONNX Runtime CPU latency at batch 1 and 8 before and after (median of timed
runs after warm-up, fixed thread count, sequential execution), the measured
speedup, and its efficiency = measured speedup / (1 / MACs ratio), i.e. the
fraction of the MACs-ideal speedup that the CPU delivers.

Every model file is written by ``optkit.export.onnx.export_onnx``, so each one is
verified against PyTorch before it is timed. The unpruned and pruned sessions
of a model are timed interleaved (one run of each in turn), so a change in
machine load while the benchmark runs slows all of them alike instead of
biasing the speedup; the load average is recorded next to the figures.

Run (timings only mean something when nothing else heavy runs; other
benchmarks on this machine take the same lock)::

    flock /tmp/optkit-bench.lock python benchmarks/speedup.py
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torchvision

from optkit.io.files import write_text
from optkit.export.onnx import export_onnx
from optkit.analysis.metrics import count_macs
from optkit.passes.prune.passes import StructuredPrune

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
RATIOS = (0.3, 0.5)
BATCHES = (1, 8)
INPUT_SHAPE = (1, 3, 224, 224)
OPT_LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
RESULTS = Path(__file__).parent / "results"
NOTES = [
    "In vit_b_16 StructuredPrune keeps the 12 attention heads and shrinks each head's dimensions alike (the "
    "residual width with them) and the MLP hidden units, and writes hidden_dim back, so attention shrinks too.",
    "torchvision zero-initializes vit_b_16's classifier head, so with random weights its outputs are exactly "
    "zero and its export check is trivial there (latency does not depend on the weights' values).",
    "Both the unpruned and pruned models go through the same export (BatchNorm folded, TorchScript exporter "
    "unless it fails) and the same ONNX Runtime settings.",
    "The 1-minute load average at the start and end of each model is in the last column. The benchmark's own "
    "threads add about 1 each; more than that means something else was running and absolute milliseconds are "
    "inflated (interleaved timing keeps the before/after ratio fair).",
]


def session(path: Path, threads: int, level: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = OPT_LEVELS[level]
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def interleaved_latency(sessions: list[ort.InferenceSession], batch: int, *, warmup: int, repeats: int) -> list[dict]:
    """Median/min latency (ms) of each session, timing one run of each in turn."""
    feed = np.random.default_rng(0).standard_normal((batch, *INPUT_SHAPE[1:]), dtype=np.float32)
    runs = [lambda s=s: s.run(None, {s.get_inputs()[0].name: feed}) for s in sessions]
    for run in runs:
        for _ in range(warmup):
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, out in zip(runs, samples):
            start = time.perf_counter()
            run()
            out.append((time.perf_counter() - start) * 1000.0)
    return [{"median_ms": round(statistics.median(s), 3), "min_ms": round(min(s), 3),
             "spread": round(float(np.percentile(s, 90)) / statistics.median(s), 3)} for s in samples]


def bench_model(name: str, args, scratch: Path) -> dict:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name).eval()
    base_macs = count_macs(model, INPUT_SHAPE)
    entries = [{"ratio": 0.0, "macs": base_macs}]
    paths = [scratch / f"{name}-0.onnx"]
    export_onnx(model, paths[0], INPUT_SHAPE, exporter=args.exporter)
    for ratio in args.ratios:
        pruned = copy.deepcopy(model)
        start = time.perf_counter()
        StructuredPrune(ratio=ratio, round_to=args.round_to, input_shape=INPUT_SHAPE)(pruned)
        prune_s = time.perf_counter() - start
        macs = count_macs(pruned, INPUT_SHAPE)
        path = scratch / f"{name}-{ratio}.onnx"
        result = export_onnx(pruned, path, INPUT_SHAPE, exporter=args.exporter)
        entries.append({"ratio": ratio, "macs": macs, "macs_ratio": round(macs / base_macs, 4),
                        "prune_seconds": round(prune_s, 2), "exporter": result.exporter,
                        "max_abs_diff": max(v.max_abs_diff for v in result.verification),
                        "max_abs_output": max(v.max_abs_ref for v in result.verification)})
        paths.append(path)
    sessions = [session(p, args.threads, args.opt_level) for p in paths]
    load_before = os.getloadavg()[0]
    for batch in args.batches:
        timings = interleaved_latency(sessions, batch, warmup=args.warmup, repeats=args.repeats)
        for entry, timing in zip(entries, timings):
            entry[f"batch{batch}"] = timing
        for entry in entries[1:]:
            speedup = entries[0][f"batch{batch}"]["median_ms"] / entry[f"batch{batch}"]["median_ms"]
            entry[f"batch{batch}"]["speedup"] = round(speedup, 3)
            entry[f"batch{batch}"]["efficiency"] = round(speedup * entry["macs_ratio"], 3)
    return {"model": name, "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "runs": entries}


def summary(models: list[dict], ratios, batches) -> dict:
    out = {}
    for ratio in ratios:
        for batch in batches:
            values = [run[f"batch{batch}"]["efficiency"] for m in models for run in m["runs"] if run["ratio"] == ratio]
            out[f"ratio{ratio}_batch{batch}_median_efficiency"] = round(statistics.median(values), 3)
    return out


def to_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# Structured pruning: ONNX Runtime CPU speedup vs MACs", "",
             f"Command: `{report['command']}`", "",
             f"Measured {report['date']} on {report['machine']}; onnxruntime {cfg['onnxruntime']}, "
             f"torch {cfg['torch']}, {cfg['threads']} intra-op threads, sequential execution, graph optimization "
             f"level `{cfg['opt_level']}`, exporter `{cfg['exporter']}`, StructuredPrune round_to={cfg['round_to']}, "
             f"input {'x'.join(map(str, INPUT_SHAPE[1:]))}, median of {cfg['repeats']} interleaved runs after "
             f"{cfg['warmup']} warm-up runs. Random-init weights (latency does not depend on them).", "",
             "Efficiency = measured speedup / (1 / MACs ratio): 1.0 means the CPU delivers the whole MACs saving.", "",
             "| model | ratio | MACs ratio | b1 before ms | b1 after ms | b1 speedup | b1 efficiency "
             "| b8 before ms | b8 after ms | b8 speedup | b8 efficiency | load avg (start, end) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in report["models"]:
        base = m["runs"][0]
        for run in m["runs"][1:]:
            cells = [m["model"], f"{run['ratio']}", f"{run['macs_ratio']:.3f}"]
            for batch in (1, 8):
                key = f"batch{batch}"
                if key in run:
                    cells += [f"{base[key]['median_ms']:.1f}", f"{run[key]['median_ms']:.1f}",
                              f"{run[key]['speedup']:.2f}", f"{run[key]['efficiency']:.2f}"]
                else:
                    cells += ["", "", "", ""]
            cells.append(", ".join(map(str, m["load_avg_1min"])))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"## Median efficiency across the {len(report['models'])} models", ""]
    lines += [f"- {key}: **{value:.3f}**" for key, value in report["summary"].items()]
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision names")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated structured ratios")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--round-to", type=int, default=16,
                        help="StructuredPrune round_to; 16 fp32 values fill one AVX-512 register, the block ONNX Runtime's NCHWc convolutions use")
    parser.add_argument("--opt-level", choices=sorted(OPT_LEVELS), default="all")
    parser.add_argument("--exporter", choices=["auto", "torchscript", "dynamo"], default="auto")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads; on the 2-core benchmark machine 1 thread ran faster "
                             "than 2 for most models (see speedup-2threads.md)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--note", action="append", default=[], help="a note about this run for the report")
    parser.add_argument("--out", default=str(RESULTS / "speedup"), help="output path without extension")
    args = parser.parse_args(argv)
    args.ratios = [float(r) for r in args.ratios.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    models: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="optkit-speedup-") as scratch:
        for name in args.models.split(","):
            models.append(bench_model(name, args, Path(scratch)))
            print(json.dumps(models[-1]), flush=True)
            # Written after every model, so an interrupted run keeps what it measured.
            write_results(args, argv, models, started)


def write_results(args, argv, models: list[dict], started: float) -> None:
    report = {
        "command": "flock /tmp/optkit-bench.lock python benchmarks/speedup.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".replace("  ", " "),
        "config": {"threads": args.threads, "opt_level": args.opt_level, "exporter": args.exporter,
                   "round_to": args.round_to, "warmup": args.warmup, "repeats": args.repeats,
                   "onnxruntime": ort.__version__, "torch": torch.__version__},
        "seconds": round(time.perf_counter() - started, 1),
        "models": models,
        "summary": summary(models, args.ratios, args.batches),
        "notes": NOTES + args.note,
    }
    out = Path(args.out)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_text(out.with_suffix(".md"), to_markdown(report))


if __name__ == "__main__":
    main()
