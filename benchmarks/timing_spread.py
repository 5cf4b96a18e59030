"""How far apart repeated timings of the same pruned copies land: is a latency fraction read out of order by noise?

The latency-target engine reads each copy it tries once (30 calls interleaved
with the unpruned file, the median over the original's), and the budget search
builds on those readings. In one budget run a copy at 0.40 of the MACs read
0.38 of the latency and one at 0.45 read 0.53. This script prunes the
benchmark's trained efficientnet_b0 (as ``benchmarks/budget.py`` trains it,
cached) to a row of MACs fractions with the default ``macs`` target (the same
copy every time: no timing decides it), exports each, and times the unpruned
file and all copies interleaved, ``--runs`` times, exactly as the engine does
(``interleaved_latency``, 30 repeats, 2 threads, batch 1). Writes
``benchmarks/results/timing-spread.{json,md}``: each copy's median, lowest and
highest fraction over the runs, and whether the medians rise with the MACs.
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

import numpy as np

from _results import RESULTS, destination, partial_options
from budget import model_spec
from optkit.analysis.latency import cpu_model, interleaved_latency
from optkit.core.files import write_text
from optkit.export.onnx import export_onnx
from optkit.io import models as model_io
from optkit.passes.prune.passes import StructuredPrune

SHAPE = (1, 3, 224, 224)
THREADS, REPEATS = 2, 30
MACS = (0.30, 0.35, 0.40, 0.45, 0.50, 0.55)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="interleaved timing runs of all copies")
    parser.add_argument("--train-steps", type=int, default=300, help="training steps of the model (budget.py's)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "optkit-bench" / "budget"),
                        help="where budget.py trains its 224-px models once")
    parser.add_argument("--out", default=str(RESULTS / "timing-spread"), help="output path without extension")
    args = parser.parse_args(argv)
    out = destination(args.out, partial_options(parser, args, ["runs", "train_steps"]))

    model = model_io.load(model_spec("efficientnet_b0", args)).model.eval()
    load_start = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="optkit-timing-spread-") as folder:
        paths = [os.path.join(folder, "original.onnx")]
        export_onnx(model, paths[0], SHAPE, dynamic_batch=False)
        macs = []
        for aim in MACS:
            result = StructuredPrune(target_macs=aim, input_shape=SHAPE).apply(copy.deepcopy(model))
            paths.append(os.path.join(folder, f"macs{aim}.onnx"))
            export_onnx(result.model, paths[-1], SHAPE, dynamic_batch=False)
            macs.append(result.details["achieved_fraction"])
        runs = []
        for _ in range(args.runs):
            before, *after = interleaved_latency(paths, SHAPE, threads=THREADS, repeats=REPEATS)
            runs.append({"original_ms": round(before.median_ms, 4),
                         "fractions": [round(a.median_ms / before.median_ms, 4) for a in after]})
            print(json.dumps(runs[-1]), flush=True)
    table = np.array([r["fractions"] for r in runs])
    copies = [{"macs_fraction": m, "median": round(float(np.median(col)), 4), "lowest": round(float(col.min()), 4),
               "highest": round(float(col.max()), 4)} for m, col in zip(macs, table.T)]
    medians = [c["median"] for c in copies]
    report = {"command": "flock /tmp/optkit-bench.lock python benchmarks/timing_spread.py "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)", "threads": THREADS, "batch": 1,
              "repeats": REPEATS, "load_avg_at_start": load_start,
              "load_avg_at_end": [round(v, 2) for v in os.getloadavg()], "runs": runs, "copies": copies,
              "medians_rise_with_macs": all(a < b for a, b in zip(medians, medians[1:]))}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    lines = [f"# Timing spread of fixed pruned copies ({report['machine']})", "",
             f"`{report['command']}` — {report['date']}, ONNX Runtime FP32, {THREADS} threads, batch 1, "
             f"{REPEATS} calls per file per run, {args.runs} runs; load average {load_start} at the start, "
             f"{report['load_avg_at_end']} at the end.", "",
             "| MACs fraction | median latency fraction | lowest | highest |", "|---:|---:|---:|---:|",
             *(f"| {c['macs_fraction']:.3f} | {c['median']:.3f} | {c['lowest']:.3f} | {c['highest']:.3f} |"
               for c in copies), "",
             f"Medians rise with the MACs: {'yes' if report['medians_rise_with_macs'] else 'no'}."]
    write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
