"""Pruning time and peak memory vs model size: resnet18 -> resnet152.

Each model runs in its own fresh Python process, so its peak RSS
(``ru_maxrss``) is its own and not the high-water mark of an earlier, larger
model. Per model the worker records: RSS after building the model, peak RSS
after structured pruning (ratio 0.3, 1x3x224x224 input), the pruning pass's
wall time, and -- when optkit has an ``export`` module -- the peak after ONNX
export too.

Run (timings matter, so take the shared benchmark lock):

    flock /tmp/optkit-bench.lock python benchmarks/resources.py

Writes benchmarks/results/resources.json and resources.md (``--name`` changes
the base name; ``--models`` and ``--repeats`` narrow a run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import destination, partial_options

MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "flock /tmp/optkit-bench.lock python benchmarks/resources.py"


def worker(name: str, ratio: float, export: bool, repeats: int) -> dict:
    """Measure one model in this (fresh) process; returns plain numbers."""
    import resource
    import tempfile

    import torch

    from optkit.io.models import load_model
    from optkit.model.stats import count_params
    from optkit.passes.prune.passes import StructuredPrune

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    torch.manual_seed(0)
    model = load_model(f"torchvision:{name}").eval()
    row = {"model": name, "params_before": count_params(model), "peak_rss_after_build_mib": round(peak_mib(), 1)}
    prune = StructuredPrune(ratio=ratio, input_shape=(1, 3, 224, 224))
    seconds, cpu_seconds = [], []
    for repeat in range(repeats):
        if repeat:
            model = load_model(f"torchvision:{name}").eval()
        start, cpu_start = time.perf_counter(), time.process_time()
        prune.apply(model)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        if not repeat:
            row["peak_rss_after_prune_mib"] = round(peak_mib(), 1)
    row["prune_seconds_min"] = round(min(seconds), 3)
    row["prune_seconds_median"] = round(statistics.median(seconds), 3)
    row["prune_cpu_seconds_min"] = round(min(cpu_seconds), 3)
    row["params_after"] = count_params(model)
    row["load_average_1min"] = round(os.getloadavg()[0], 2)
    if export:
        from optkit.export import onnx as export_module

        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            export_module.export_onnx(model, Path(tmp) / "model.onnx", input_shape=(1, 3, 224, 224))
            row["export_seconds"] = round(time.perf_counter() - start, 3)
        row["peak_rss_after_export_mib"] = round(peak_mib(), 1)
    return row


def _has_export() -> bool:
    import importlib.util

    return importlib.util.find_spec("optkit.export.onnx") is not None


def run_all(models: tuple[str, ...], ratio: float, export: bool, repeats: int) -> list[dict]:
    rows = []
    for name in models:
        command = [sys.executable, __file__, "--worker", name, "--ratio", str(ratio), "--repeats", str(repeats)]
        if not export:
            command.append("--no-export")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    export = any("export_seconds" in r for r in rows)
    head = ["model", "params", "params after", "prune s (min)", "prune s (median)", "prune CPU s (min)", "peak RSS built (MiB)",
            "peak RSS pruned (MiB)", "load avg"]
    if export:
        head += ["export s", "peak RSS exported (MiB)"]
    lines = [
        "# Pruning time and peak memory vs model size",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Structured pruning at ratio {meta['ratio']} (group L1, round_to 8), input 1x3x224x224, "
        f"random weights, one fresh process per model, pruning timed {meta['repeats']} times on fresh copies "
        f"(min and median); peak RSS is `ru_maxrss` of that process after the first prune "
        f"(includes ~{meta['baseline_rss_mib']} MiB for Python + torch). Machine: {meta['machine']}, "
        f"torch {meta['torch']}, {meta['date']}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["model"], f"{r['params_before'] / 1e6:.1f}M", f"{r['params_after'] / 1e6:.1f}M",
                 f"{r['prune_seconds_min']:.2f}", f"{r['prune_seconds_median']:.2f}", f"{r['prune_cpu_seconds_min']:.2f}",
                 f"{r['peak_rss_after_build_mib']:.0f}", f"{r['peak_rss_after_prune_mib']:.0f}", f"{r['load_average_1min']:.1f}"]
        if export:
            cells += [f"{r.get('export_seconds', float('nan')):.2f}", f"{r.get('peak_rss_after_export_mib', float('nan')):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The machine is shared with other jobs (the 1-minute load average at the end of each model's run is "
              "shown): read the timings as a trend, the minimum as the least disturbed figure. CPU seconds "
              "(process time, all threads) are less sensitive to other jobs than wall time."]
    return "\n".join(lines) + "\n"


def _baseline_rss() -> float:
    code = "import resource, torch, torchvision; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return round(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3, help="Pruning runs per model (fresh copies).")
    parser.add_argument("--no-export", action="store_true", help="Skip the ONNX export measurement.")
    parser.add_argument("--name", default="resources", help="Base name of the results files.")
    parser.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.ratio, _has_export() and not args.no_export, args.repeats)))
        return
    import torch

    export = _has_export() and not args.no_export
    rows = run_all(tuple(args.models), args.ratio, export, args.repeats)
    # Fewer models or repeats than the committed run: written elsewhere (see _results.py).
    folder = destination(RESULTS, partial_options(parser, args, ["models", "repeats", "no_export"]))
    meta = {"command": " ".join([COMMAND, *sys.argv[1:]]), "ratio": args.ratio, "repeats": args.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "baseline_rss_mib": _baseline_rss()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (folder / f"{args.name}.md").write_text(to_markdown(meta, rows))
    print((folder / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
