"""How steady is a pruned copy's time in another runtime, read against ONNX Runtime FP32 or its own unpruned build?

The budget search times each try in its deployment (OpenVINO bf16, say) with
the unpruned ONNX Runtime FP32 file and rescales it. Scaled by the FP32 file
alone, a try's figure carries how fast OpenVINO ran against ONNX Runtime in
that one run; scaled by the deployment's own unpruned build in the same run
(whose time is the median of its readings so far, see
``optkit.passes.deploy.search._Search.timed``), it does not. This script builds
the benchmark's trained efficientnet_b0 (as ``benchmarks/budget.py`` trains it,
cached) and a copy pruned to ``--macs`` of its MACs (the default ``macs``
target: no timing decides it), each as ONNX Runtime FP32 and OpenVINO bf16, and
times the four interleaved ``--runs`` times, as the search times (30 calls,
2 threads, batch 1). Per run it records the copy's OpenVINO time over the FP32
file's (the old scaling), over its own unpruned build, and the search's
estimate (that ratio times the median over the runs so far of the unpruned
build's time over the FP32 file's). With ``--finetune-between N`` a copy of
the model is fine-tuned N steps between runs, as the search's process prunes,
re-estimates and builds between its timings. Writes
``benchmarks/results/runtime-drift.{json,md}``.
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
from pathlib import Path

from _results import RESULTS, destination, partial_options
from budget import model_spec
from optkit.analysis.latency import Deployment, cpu_model, interleaved_latency
from optkit.core.files import write_text
from optkit.export.onnx import export_onnx
from optkit.io import models as model_io
from optkit.passes.deploy.convert import openvino_ir
from optkit.passes.deploy.settings import DeploySettings
from optkit.passes.finetune.passes import FineTune
from optkit.passes.prune.passes import StructuredPrune

SHAPE = (1, 3, 224, 224)
THREADS, REPEATS = 2, 30
RUNTIME, PRECISION = "openvino", "bf16"


def spread(values: list[float]) -> dict[str, float]:
    """Lowest, median, highest and standard deviation of ``values``, rounded."""
    return {"lowest": round(min(values), 4), "median": round(statistics.median(values), 4),
            "highest": round(max(values), 4), "stdev": round(statistics.stdev(values), 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16, help="interleaved timing runs of the four files")
    parser.add_argument("--macs", type=float, default=0.5, help="MACs fraction the copy is pruned to")
    parser.add_argument("--finetune-between", type=int, default=0,
                        help="fine-tuning steps of a copy of the model between runs (0: runs back to back)")
    parser.add_argument("--train-steps", type=int, default=300, help="training steps of the model (budget.py's)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "optkit-bench" / "budget"),
                        help="where budget.py trains its 224-px models once")
    parser.add_argument("--out", help="output path without extension (default: results/runtime-drift, with "
                                      "-finetuneN for --finetune-between N)")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2 (a spread needs two readings)")
    named = "runtime-drift" + (f"-finetune{args.finetune_between}" if args.finetune_between else "")
    out = destination(args.out or RESULTS / named, partial_options(parser, args, ["runs", "macs", "train_steps"]))

    model = model_io.load(model_spec("efficientnet_b0", args)).model.eval()
    load_start = [round(v, 2) for v in os.getloadavg()]
    settings = DeploySettings(calib_data="fashion-mnist", threads=THREADS, batch=1)
    with tempfile.TemporaryDirectory(prefix="optkit-runtime-drift-") as folder:
        unpruned, pruned = Path(folder, "unpruned.onnx"), Path(folder, "pruned.onnx")
        export_onnx(model, unpruned, SHAPE, dynamic_batch=False)
        result = StructuredPrune(target_macs=args.macs, input_shape=SHAPE).apply(copy.deepcopy(model))
        export_onnx(result.model, pruned, SHAPE, dynamic_batch=False)
        built = []
        for source in (unpruned, pruned):
            target = source.with_name(f"{source.stem}-{PRECISION}.xml")
            openvino_ir(source, target, PRECISION, settings, input_shape=SHAPE)
            built.append(Deployment(target, RUNTIME, PRECISION))
        files = [Deployment(unpruned), Deployment(pruned), *built]
        runs, unpruned_readings = [], []
        for _ in range(args.runs):
            if args.finetune_between:
                FineTune(data="fashion-mnist", max_steps=args.finetune_between, epochs=1, batch_size=32,
                         input_shape=SHAPE).apply(copy.deepcopy(model))
            fp32, fp32_copy, other, other_copy = (t.median_ms for t in interleaved_latency(
                files, SHAPE, threads=THREADS, repeats=REPEATS))
            unpruned_readings.append(other / fp32)
            runs.append({"fp32_ms": round(fp32, 4), "fp32_copy_over_fp32": round(fp32_copy / fp32, 4),
                         "unpruned_over_fp32": round(other / fp32, 4),
                         "copy_over_fp32": round(other_copy / fp32, 4),
                         "copy_over_its_unpruned": round(other_copy / other, 4),
                         "search_estimate": round(other_copy / other * statistics.median(unpruned_readings), 4)})
            print(json.dumps(runs[-1]), flush=True)
    measures = ("fp32_copy_over_fp32", "unpruned_over_fp32", "copy_over_fp32", "copy_over_its_unpruned",
                "search_estimate")
    report = {"command": "flock /tmp/optkit-bench.lock python benchmarks/runtime_drift.py "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)", "threads": THREADS, "batch": 1,
              "repeats": REPEATS, "finetune_between": args.finetune_between, "deployment": f"{RUNTIME}-{PRECISION}",
              "macs_fraction": round(result.details["achieved_fraction"], 4), "load_avg_at_start": load_start,
              "load_avg_at_end": [round(v, 2) for v in os.getloadavg()], "runs": runs,
              "spread": {m: spread([r[m] for r in runs]) for m in measures}}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    words = {"fp32_copy_over_fp32": "ONNX Runtime FP32: copy / unpruned",
             "unpruned_over_fp32": "OpenVINO bf16 unpruned / ONNX Runtime FP32 unpruned",
             "copy_over_fp32": "OpenVINO bf16 copy / ONNX Runtime FP32 unpruned (scaled by the FP32 file alone)",
             "copy_over_its_unpruned": "OpenVINO bf16 copy / OpenVINO bf16 unpruned",
             "search_estimate": "the search's estimate of the copy / ONNX Runtime FP32 unpruned"}
    lines = [f"# A pruned copy's time in OpenVINO bf16, read two ways ({report['machine']})", "",
             f"`{report['command']}` — {report['date']}, efficientnet_b0 (trained by budget.py) and a copy at "
             f"{report['macs_fraction']:.3f} of its MACs, {THREADS} threads, batch 1, {REPEATS} calls per file per "
             f"run, {args.runs} interleaved runs"
             + (f", {args.finetune_between} fine-tuning steps between runs" if args.finetune_between else "")
             + f"; load average {load_start} at the start, "
             f"{report['load_avg_at_end']} at the end.", "",
             "| ratio | lowest | median | highest | stdev |", "|---|---:|---:|---:|---:|",
             *(f"| {words[m]} | {s['lowest']:.3f} | {s['median']:.3f} | {s['highest']:.3f} | {s['stdev']:.3f} |"
               for m, s in report["spread"].items()), "",
             "The search's estimate: the copy over its own unpruned build in the run, times the median over the "
             "runs so far of that build over the FP32 file (what `_Search.timed` does)."]
    write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
