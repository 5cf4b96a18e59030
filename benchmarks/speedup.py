"""Measured ONNX Runtime CPU speed-up of structured pruning, against the MACs it removes.

For each model: the unpruned model, optkit's default ``--prune 0.3`` path
(``StructuredPrune`` with its default settings) and torch-pruning called
directly the way a first-time user would (``BasePruner``, group L1
importance, ratio 0.3, ``round_to`` 8, the classifier and any
``nn.MultiheadAttention`` ignored). All three are exported with
:func:`optkit.export.onnx.export_onnx` (verified against PyTorch) and timed in
ONNX Runtime at every thread count and batch size of the run with
:func:`optkit.analysis.latency.interleaved_latency`: alternating blocks, one
session alive at a time, spinning thread pools as ONNX Runtime serves.

Efficiency = measured speed-up / (1 / MACs ratio): 1.0 means the CPU delivers
the whole MACs saving.

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
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch
import torchvision

from optkit.analysis.latency import cpu_model, interleaved_latency
from _results import destination, partial_options

from optkit.core.files import write_text
from optkit.export.onnx import export_onnx
from optkit.model.stats import count_macs
from optkit.passes.prune.passes import StructuredPrune

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
RATIO = 0.3
THREADS = (2, 1)
BATCHES = (1, 8)
INPUT_SHAPE = (1, 3, 224, 224)
VARIANTS = ("optkit", "torch_pruning")
RESULTS = Path(__file__).parent / "results"
NOTES = [
    "Timing: for each thread count and batch, the three files of a model are timed in alternating blocks of "
    "2 calls, each block on a fresh session after 3 untimed calls, one session alive at a time, with ONNX "
    "Runtime's default spinning thread pool. Earlier runs kept all sessions alive with spinning turned off; "
    "that charges each operator a thread wake-up at 2 threads and made pruned (smaller) models look up to "
    "25% less efficient than they are when served. Runs before 2026-12-04 used blocks of 5: fresh sessions "
    "of one file differ by up to 15% on this virtual machine, so fewer, longer blocks let one unlucky "
    "session move a median.",
    "torch-pruning direct: BasePruner(GroupMagnitudeImportance(p=1), pruning_ratio=0.3, round_to=8), ignoring "
    "the last Linear and every nn.MultiheadAttention (it breaks them otherwise).",
    "torchvision zero-initializes vit_b_16's classifier head, so with random weights its outputs are exactly "
    "zero and its export check is trivial there (latency does not depend on the weights' values).",
    "The 1-minute load average at the start and end of each model is in the last column; the benchmark's own "
    "threads add up to 2.",
]


def prune_direct(model: torch.nn.Module) -> torch.nn.Module:
    """torch-pruning as its README shows it, with the layers it cannot prune ignored."""
    import torch_pruning as tp

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ignored = linears[-1:] + [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    pruner = tp.pruner.BasePruner(model, torch.randn(INPUT_SHAPE), importance=tp.importance.GroupMagnitudeImportance(p=1),
                                  pruning_ratio=RATIO, ignored_layers=ignored, round_to=8)
    pruner.step()
    return model


def bench_model(name: str, args, scratch: Path) -> dict:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name).eval()
    base_macs = count_macs(model, INPUT_SHAPE)
    variants = {"optkit": lambda m: StructuredPrune(ratio=RATIO, input_shape=INPUT_SHAPE)(m), "torch_pruning": prune_direct}
    paths = [scratch / f"{name}-original.onnx"]
    export_onnx(model, paths[0], INPUT_SHAPE)
    entries: dict[str, dict] = {}
    for variant, prune in variants.items():
        pruned = copy.deepcopy(model)
        start = time.perf_counter()
        try:
            prune(pruned)
        except Exception as e:  # torch-pruning direct may fail; that is a result
            entries[variant] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        seconds = time.perf_counter() - start
        path = scratch / f"{name}-{variant}.onnx"
        export_onnx(pruned.eval(), path, INPUT_SHAPE)
        entries[variant] = {"macs_ratio": round(count_macs(pruned, INPUT_SHAPE) / base_macs, 4),
                            "prune_seconds": round(seconds, 2), "path": path}
        paths.append(path)
    timed = [v for v in VARIANTS if "path" in entries[v]]
    load_before = os.getloadavg()[0]
    original: dict[str, float] = {}
    for threads in args.threads:
        for batch in args.batches:
            key = f"t{threads}_b{batch}"
            results = interleaved_latency(paths, (batch, *INPUT_SHAPE[1:]), threads=threads, warmup=3,
                                          repeats=args.repeats)
            original[key] = round(results[0].median_ms, 3)
            for variant, result in zip(timed, results[1:]):
                speedup = results[0].median_ms / result.median_ms
                entries[variant][key] = {"median_ms": round(result.median_ms, 3), "spread": round(result.spread, 3),
                                         "speedup": round(speedup, 3),
                                         "efficiency": round(speedup * entries[variant]["macs_ratio"], 3)}
    for entry in entries.values():
        entry.pop("path", None)
    return {"model": name, "original_ms": original, **entries,
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def summary(models: list[dict], args) -> dict:
    out = {}
    for variant in VARIANTS:
        for threads in args.threads:
            for batch in args.batches:
                key = f"t{threads}_b{batch}"
                values = [m[variant][key]["efficiency"] for m in models if key in m[variant]]
                if values:
                    out[f"{variant} {threads} thread(s) batch {batch}"] = round(statistics.median(values), 3)
    return out


def to_markdown(report: dict) -> str:
    keys = [f"t{t}_b{b}" for t in report["config"]["threads"] for b in report["config"]["batches"]]
    header = " | ".join(f"{k.replace('_', ' ')} ms / eff." for k in keys)
    lines = ["# Structured pruning: ONNX Runtime CPU speed-up vs MACs", "",
             f"Command: `{report['command']}`", "",
             f"Measured {report['date']} on {report['machine']}; onnxruntime {report['config']['onnxruntime']}, "
             f"torch {report['config']['torch']}, input {'x'.join(map(str, INPUT_SHAPE[1:]))}, ratio {RATIO}, "
             f"median of {report['config']['repeats']} timed calls per file and setting ({report['seconds']:.0f} s "
             "in all). Random-init weights (latency does not depend on them). tN bM: N intra-op threads, batch M.", "",
             "Efficiency = measured speed-up / (1 / MACs ratio).", "",
             f"| model | variant | MACs ratio | prune s | {header} | load avg (start, end) |",
             "|---|---|---:|---:|" + "---:|" * len(keys) + "---|"]
    for m in report["models"]:
        lines.append(f"| {m['model']} | original | 1.000 | | "
                     + " | ".join(f"{m['original_ms'][k]:.1f}" for k in keys) + f" | {', '.join(map(str, m['load_avg_1min']))} |")
        for variant in VARIANTS:
            entry = m[variant]
            if "error" in entry:
                lines.append(f"| | {variant} | {entry['error']} | |" + " |" * len(keys) + " |")
                continue
            cells = [f"{entry[k]['median_ms']:.1f} / {entry[k]['efficiency']:.2f}" for k in keys]
            lines.append(f"| | {variant} | {entry['macs_ratio']:.3f} | {entry['prune_seconds']:.1f} | "
                         + " | ".join(cells) + " | |")
    lines += ["", f"## Median efficiency over the {len(report['models'])} models", ""]
    lines += [f"- {key}: **{value:.3f}**" for key, value in report["summary"].items()]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision names")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="comma-separated intra-op threads")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per file and setting")
    parser.add_argument("--note", action="append", default=[], help="a note about this run for the report")
    parser.add_argument("--out", default=str(RESULTS / "speedup"), help="output path without extension")
    args = parser.parse_args(argv)
    # Fewer models, settings or repeats than the committed run: written elsewhere (see _results.py).
    partial = partial_options(parser, args, ["models", "threads", "batches", "repeats"])
    args.out = str(destination(args.out, partial))
    args.threads = [int(t) for t in args.threads.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
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
        "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)",
        "config": {"threads": args.threads, "batches": args.batches, "repeats": args.repeats,
                   "onnxruntime": ort.__version__, "torch": torch.__version__},
        "seconds": round(time.perf_counter() - started, 1),
        "models": models,
        "summary": summary(models, args),
        "notes": NOTES + args.note,
    }
    out = Path(args.out)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_text(out.with_suffix(".md"), to_markdown(report))


if __name__ == "__main__":
    main()
