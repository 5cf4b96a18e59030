"""``target_macs=0.5`` at round_to 16, 8, 4 and 2: what channel alignment does to ONNX Runtime latency.

A MACs target often cannot be met by one ratio at round_to 16 (small layers move in coarse
steps). optkit then cuts groups by different multiples of 16; before, it halved round_to until
one ratio reached the target (the torchvision resnets landed on 4 and 8, the Fashion-MNIST
baseline on 2). This benchmark prunes each model to the same target at each round_to and times
the results against the original, interleaved, at batch 1 with 2 threads and 1 thread (and at
batch 64 for the 28x28 Fashion-MNIST model, whose batch-1 call is mostly ONNX Runtime's own cost).

Usage (nothing else running; it takes about 5 minutes):

    flock /tmp/optkit-bench.lock python benchmarks/round_to.py [MODEL ...]

Writes benchmarks/results/round-to.json and round-to.md; a run of some of the models writes them to a
temporary folder instead (see ``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import destination  # noqa: E402

from optkit.analysis.latency import interleaved_latency  # noqa: E402
from optkit.core.files import write_text  # noqa: E402
from optkit.export.onnx import export_onnx  # noqa: E402
from optkit.model.stats import count_macs  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("fashion_resnet", "resnet18", "resnet50", "mobilenet_v2")
ROUND_TOS = (16, 8, 4, 2)
TARGET = 0.5
THREADS = (2, 1)
REPEATS = 30


def _model(name: str):
    from optkit.demo import FASHION_RESNET
    from optkit.io.models import load_model

    if name == "fashion_resnet":
        return load_model(FASHION_RESNET).eval(), (1, 1, 28, 28), (1, 64)
    return load_model(f"torchvision:{name}").eval(), (1, 3, 224, 224), (1,)


def run_model(name: str, folder: Path) -> dict:
    """Prune ``name`` at every round_to, export each, time them all against the original."""
    import torch

    torch.manual_seed(0)
    model, shape, batches = _model(name)
    macs = count_macs(model, shape)
    paths = [folder / f"{name}-original.onnx"]
    export_onnx(model, paths[0], shape)
    variants = []
    for round_to in ROUND_TOS:
        result = StructuredPrune(target_macs=TARGET, round_to=round_to, input_shape=shape).apply(copy.deepcopy(model))
        path = folder / f"{name}-r{round_to}.onnx"
        export_onnx(result.model, path, shape)
        paths.append(path)
        widths = sorted({m.out_channels for m in result.model.modules() if hasattr(m, "out_channels")})
        variants.append({"round_to_asked": round_to, "round_to_used": result.details["round_to"],
                         "per_group": result.details.get("ratio") is None,
                         "macs_fraction": round(count_macs(result.model, shape) / macs, 4),
                         "off_16": sum(w % 16 != 0 for w in widths), "widths": len(widths)})
    runs = []
    for threads in THREADS:
        for batch in batches:
            load = os.getloadavg()[0]
            timings = interleaved_latency(paths, (batch, *shape[1:]), threads=threads, repeats=REPEATS)
            base = timings[0].median_ms
            runs.append({"threads": threads, "batch": batch, "original_ms": round(base, 4),
                         "ms": [round(t.median_ms, 4) for t in timings[1:]],
                         "speedup": [round(base / t.median_ms, 3) for t in timings[1:]],
                         "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)]})
            print(name, runs[-1], flush=True)
    return {"model": name, "input_shape": list(shape), "variants": variants, "runs": runs}


def to_markdown(report: dict) -> str:
    lines = ["# MACs target 0.5 at round_to 16 / 8 / 4 / 2: ONNX Runtime latency", "",
             f"Command: `{report['command']}`", "",
             f"Measured {report['date']}; onnxruntime {report['onnxruntime']}. Each model pruned with "
             f"`StructuredPrune(target_macs={TARGET}, round_to=R)` (L1, uniform allocation, defaults otherwise); "
             f"all files of a model timed interleaved against the original (median of {REPEATS} calls, one session "
             "alive at a time, spinning pools). Speed-up = original ms / pruned ms; efficiency = speed-up × MACs "
             "fraction. 'off 16' counts the distinct conv/linear widths that are not multiples of 16.", ""]
    for entry in report["models"]:
        lines += [f"## {entry['model']} ({'×'.join(map(str, entry['input_shape'][1:]))})", "",
                  "| round_to asked | used | counts | MACs | widths off 16 | "
                  + " | ".join(f"t{r['threads']} b{r['batch']} ms (×, eff.)" for r in entry["runs"]) + " |",
                  "|---:|---:|---|---:|---:|" + "---:|" * len(entry["runs"])]
        lines.append("| original | | | 1.000 | | " + " | ".join(f"{r['original_ms']:.3f}" for r in entry["runs"]) + " |")
        for i, v in enumerate(entry["variants"]):
            cells = [f"{r['ms'][i]:.3f} ({r['speedup'][i]:.2f}×, {r['speedup'][i] * v['macs_fraction']:.2f})"
                     for r in entry["runs"]]
            lines.append(f"| {v['round_to_asked']} | {v['round_to_used']} | "
                         f"{'per group' if v['per_group'] else 'one ratio'} | {v['macs_fraction']:.3f} | "
                         f"{v['off_16']} of {v['widths']} | " + " | ".join(cells) + " |")
        loads = [r["load_avg_1min"] for r in entry["runs"]]
        lines += ["", f"Load average (1 min) at the start and end of each timing: {loads}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models to measure (default: all of {', '.join(MODELS)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    import onnxruntime

    names = args.models or list(MODELS)
    partial = [f"models {','.join(names)}"] if set(names) != set(MODELS) else []
    json_path, md_path = (destination(RESULTS / name, partial) for name in ("round-to.json", "round-to.md"))
    with tempfile.TemporaryDirectory(prefix="optkit-round-to-") as scratch:
        models = [run_model(name, Path(scratch)) for name in names]
    report = {"command": "flock /tmp/optkit-bench.lock python " + " ".join(["benchmarks/round_to.py", *sys.argv[1:]]),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "onnxruntime": onnxruntime.__version__, "models": models}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(json_path, json.dumps(report, indent=1) + "\n")
    write_text(md_path, to_markdown(report) + "\n")


if __name__ == "__main__":
    main()
