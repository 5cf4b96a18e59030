"""A latency budget in, the most accurate deployment out: the joint search against two ways without it.

For each model and budget (a fraction of the unpruned model's ONNX Runtime FP32
latency at 2 threads, batch 1), three ways to meet it, in the same run:

* **joint**: ``optkit optimize MODEL --target-latency F --export onnx --deploy --calib-data fashion-mnist``
  (each candidate deployment pruned just enough, the most accurate on the val split kept);
* **(a) prune, then deploy**: ``StructuredPrune(target_latency=F, data=fashion-mnist)`` (measured in ONNX
  Runtime FP32; of the copies within its tolerance, the most accurate on the val split, as the joint search's
  engine chooses), its BatchNorm statistics re-estimated on 10 training batches (``--recalibrate-bn 10``, what the joint search does to
  every pruned try), then ``choose_deployment`` on the pruned model (the fastest verified deployment);
* **(b) quantization alone**: ``choose_deployment`` on the unpruned model.

With ``--finetune-steps N`` each way's model is fine-tuned N steps on the training images before it is deployed:
the joint search's chosen one (``--finetune``, as the search hands it on), (a)'s pruned model, and (b)'s unpruned
one, all with the same pass, data and seed.

The three chosen deployments and the unpruned ONNX Runtime FP32 file are then timed again in ``--recheck-runs``
interleaved runs (``--repeats`` x 3 calls each, blocks of 2; each way's time over the FP32 file's, the median of the
runs counting), and each one's test accuracy (the first ``--test-samples`` Fashion-MNIST
test images, never used by the search) is measured in its own runtime. A way *meets* the budget when its time
again is within 5% of it. The models: the shipped Fashion-MNIST demo (1x28x28), and resnet50, mobilenet_v2 and
efficientnet_b0 at 3x224x224 trained here on Fashion-MNIST (upscaled, 3 channels) for ``--train-steps`` steps
with ``optkit finetune`` (cached in ``--cache``: no pretrained weights can be downloaded here).

The language-model rows: the shipped model at decode targets of 1.5x and 2x its FP32 tokens/s (measured first),
the joint search (``--target-latency Ntok/s --deploy --calib-data text``) against (b) ``--deploy`` alone, both
decode graphs timed again with the FP32 one, each with its validation perplexity.

Run (timings only mean something when nothing else heavy runs; other benchmarks take the same lock)::

    flock /tmp/optkit-bench.lock python benchmarks/budget.py

A cheap run that it works (written under the partial folder, see ``_results.py``)::

    python benchmarks/budget.py --models fashion --budgets 0.9 --candidates onnxruntime-fp32,onnxruntime-int8 \
        --repeats 4 --test-samples 500 --no-language
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _results import ROOT, destination, partial_options

from optkit.analysis.latency import Deployment, cpu_model, interleaved_latency
from optkit.core.files import write_text
from optkit.demo import FASHION_RESNET
from optkit.export.onnx import export_onnx
from optkit.io import models as model_io
from optkit.model.stats import count_macs
from optkit.passes.batchnorm.passes import RecalibrateBatchNorm
from optkit.passes.deploy.choose import choose_deployment
from optkit.passes.deploy.settings import DeploySettings
from optkit.passes.finetune.passes import FineTune
from optkit.passes.prune.passes import StructuredPrune
from optkit.passes.quantize.calibration import load_batches
from optkit.runtime import openvino as ov
from optkit.runtime.onnxrt import onnx_session

#: Rows in order of cost (resnet50's take longest), so a run stopped early keeps the most rows.
MODELS = ("fashion", "mobilenet_v2", "efficientnet_b0", "resnet50")
BUDGETS = (0.5, 0.3)
THREADS = 2
BATCH = 1
DATA = "fashion-mnist"
SHAPES = {"fashion": (1, 1, 28, 28)}
TORCHVISION_SHAPE = (1, 3, 224, 224)
#: Images per step when ``--finetune-steps`` fine-tunes each way's model.
FINETUNE_BATCH = 32
#: A way meets the budget when its time, measured again, is at most this much over it.
TOLERANCE = 0.05
LM_NAME = "optkit/demo/python_docs_lm"
LM = f"hf:{ROOT / LM_NAME}"
LM_TARGETS = (1.5, 2.0)
LM_SEQ_LEN = 128
LM_PROMPT_WORDS = "128-token prompt"
RESULTS = ROOT / "benchmarks" / "results"


def model_spec(name: str, args) -> str:
    """The model file of row ``name``: the demo model, or a torchvision architecture trained here (cached)."""
    if name == "fashion":
        return str(FASHION_RESNET)
    folder = Path(args.cache) / f"{name}-{args.train_steps}"
    if not (folder / "model.pt").is_file():
        optkit(["finetune", f"torchvision:{name}", "--num-classes", "10", "--input-shape", "1,3,224,224", "--data",
                DATA, "--max-steps", str(args.train_steps), "--batch-size", "32", "--epochs", "1", "--out",
                str(folder)])
    return str(folder / "model.pt")


def optkit(words: list[str]) -> subprocess.CompletedProcess:
    """Run ``optkit WORDS`` as a user would; a failure raises with its last line."""
    done = subprocess.run([sys.executable, "-m", "optkit", *words], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["(no output)"])[-1])
    return done


def settings(args) -> DeploySettings:
    return DeploySettings(calib_data=DATA, threads=THREADS, batch=BATCH, repeats=args.repeats,
                          candidates=tuple(filter(None, args.candidates.split(","))))


def joint(spec: str, shape: tuple[int, ...], fraction: float, folder: Path, args) -> dict:
    """The joint search through the CLI; its chosen deployment's file and the report's frontier."""
    out = folder / "joint"
    start = time.perf_counter()
    optkit(["optimize", spec, "--input-shape", ",".join(map(str, shape)), "--target-latency", str(fraction),
            "--export", "onnx", "--deploy", "--calib-data", DATA, "--deploy-threads", str(THREADS), "--deploy-batch",
            str(BATCH), "--deploy-repeats", str(args.repeats), "--no-latency", "--out", str(out)]
           + (["--deploy-candidates", args.candidates] if args.candidates else [])
           + (["--finetune", DATA, "--max-steps", str(args.finetune_steps), "--epochs", "1", "--batch-size",
               str(FINETUNE_BATCH)] if args.finetune_steps else []))
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    deploy, budget = report["deploy"], report["deploy"]["budget"]
    chosen = next(p for p in budget["points"] if p["status"] == "chosen")
    return {"way": "joint", "deployment": f"{deploy['runtime']}-{deploy['precision']}", "path": out / deploy["path"],
            "macs_fraction": chosen["macs_fraction"], "efficiency": chosen["efficiency"],
            "search_s": round(time.perf_counter() - start, 1), "frontier": budget["points"],
            "remeasured_by_deploy_ms": budget.get("remeasured_ms")}


def finetuned(model, shape: tuple[int, ...], args):
    """A copy of ``model`` fine-tuned as the joint search's chosen one is with ``--finetune-steps`` (the same data,
    steps, batch and seed), else ``model`` itself."""
    if not args.finetune_steps:
        return model
    return FineTune(data=DATA, max_steps=args.finetune_steps, epochs=1, batch_size=FINETUNE_BATCH,
                    input_shape=shape).apply(copy.deepcopy(model)).model


def deployed(model, shape: tuple[int, ...], folder: Path, way: str, args, macs: float) -> dict:
    """The fastest verified deployment of ``model`` (what ``--deploy`` chooses), written in ``folder``."""
    folder.mkdir()
    path = folder / "model.onnx"
    export_onnx(model, path, shape)
    result = choose_deployment(path, settings(args), input_shape=shape, baseline=folder.parent / "unpruned.onnx")
    return {"way": way, "deployment": f"{result.runtime}-{result.precision}", "path": folder / result.path,
            "macs_fraction": round(count_macs(model, shape) / macs, 4),
            "candidates": [{k: c[k] for k in ("name", "status", "reason", "speedup")} for c in result.candidates]}


def run_row(name: str, fraction: float, args, scratch: Path) -> dict:
    shape = SHAPES.get(name, TORCHVISION_SHAPE)
    spec = model_spec(name, args)
    folder = scratch / f"{name}-{fraction}"
    folder.mkdir()
    model = model_io.load(spec).model.eval()
    macs = count_macs(model, shape)
    export_onnx(model, folder / "unpruned.onnx", shape)
    try:
        ways = [joint(spec, shape, fraction, folder, args)]
    except RuntimeError as e:  # a budget the joint search refuses: (a) and (b) show whether it was reachable
        ways = [{"way": "joint", "error": str(e)}]
    start = time.perf_counter()
    pruned = StructuredPrune(target_latency=fraction, input_shape=shape, latency_threads=THREADS,
                             latency_batch=BATCH, data=DATA).apply(model).model
    RecalibrateBatchNorm(data=DATA, batches=10, input_shape=shape).apply(pruned)
    ways.append({**deployed(finetuned(pruned, shape, args), shape, folder / "a", "a", args, macs),
                 "search_s": round(time.perf_counter() - start, 1)})
    ways.append(deployed(finetuned(model, shape, args), shape, folder / "b", "b", args, macs))
    deployments = [w for w in ways if "error" not in w]
    baseline, fractions = timed_again(folder / "unpruned.onnx", deployments, shape, args)
    budget_ms = fraction * baseline
    test = load_batches(DATA, "test", shape, batch_size=50, samples=args.test_samples)
    right = {}
    for way, readings in zip(deployments, fractions):
        hits = right[way["way"]] = correct(way, test)
        measured = float(np.median(readings))
        way.update(ms=round(measured * baseline, 4), fraction=round(measured, 4),
                   recheck_fractions=[round(r, 4) for r in readings], meets=measured <= fraction * (1 + TOLERANCE),
                   accuracy=round(float(hits.mean()), 4))
        way["path"] = way["path"].name
    if "joint" in right:
        for way in deployments[1:]:
            way["against_joint"] = {"joint_only_right": int((right["joint"] & ~right[way["way"]]).sum()),
                                    "only_right": int((right[way["way"]] & ~right["joint"]).sum())}
    return {"model": name, "budget_fraction": fraction, "test_samples": test.samples, "baseline_ms": round(baseline, 4),
            "budget_ms": round(budget_ms, 4), "ways": ways, "verdict": verdict(ways)}


def timed_again(unpruned: Path, deployments: list[dict], shape: tuple[int, ...],
                args) -> tuple[float, list[list[float]]]:
    """The unpruned ONNX Runtime FP32 file's median time over ``--recheck-runs`` interleaved runs with the
    deployments (``--repeats`` x 3 calls each), and each deployment's time over that file's, one per run.

    One run reads a deployment in another runtime against ONNX Runtime FP32 within about +-10 % on a 2-CPU VM
    (``results/runtime-drift.md``, 30 calls a run: 0.415-0.517 of it around 0.475; the efficientnet_b0 0.5 row's
    three rechecks of 60 calls, 0.402-0.465): the median of a few is what the deployment runs at."""
    files = [Deployment(unpruned), *(Deployment(w["path"], *w["deployment"].split("-")) for w in deployments)]
    baselines, fractions = [], [[] for _ in deployments]
    for _ in range(args.recheck_runs):
        first, *rest = interleaved_latency(files, (BATCH, *shape[1:]), threads=THREADS, warmup=3,
                                           repeats=args.repeats * 3)
        baselines.append(first.median_ms)
        for readings, latency in zip(fractions, rest):
            readings.append(latency.median_ms / first.median_ms)
    return float(np.median(baselines)), fractions


def correct(way: dict, test) -> np.ndarray:
    """Whether ``way``'s deployment, in its own runtime, classifies each test image right."""
    runtime, precision = way["deployment"].split("-")
    session = (ov.session(way["path"], THREADS, precision=precision) if runtime == "openvino"
               else onnx_session(way["path"], THREADS))
    name = session.get_inputs()[0].name
    return np.concatenate([np.argmax(session.run(None, {name: x})[0], 1) == y for x, y in zip(test.inputs, test.labels)])


def verdict(ways: list[dict]) -> str:
    joint_way, *others = ways
    meeting = [w for w in others if w["meets"]]
    if "error" in joint_way:
        return "joint refused it; " + ("(a) or (b) met it" if meeting else "neither (a) nor (b) met it either")
    if not joint_way["meets"]:
        return "joint missed the budget"
    if not meeting:
        return "joint met it; neither (a) nor (b) did"
    best = max(w["accuracy"] for w in meeting)
    return ("better" if joint_way["accuracy"] > best else "equal" if joint_way["accuracy"] == best else "worse")


def language_row(multiple: float, args, scratch: Path) -> dict:
    """The shipped language model at a decode target of ``multiple`` x its FP32 tokens/s (2 threads, batch 1):
    the joint search against (b) ``--deploy`` alone ((a) needs a latency engine for transformers, which optkit has
    not: its latency target is for conv/linear models), each deployment's decode timed again with the unpruned
    FP32 graph, and its validation perplexity from its check."""
    from optkit.export import decode
    from optkit.passes.deploy.tokens import decode_timer

    folder = scratch / f"lm-{multiple}"
    folder.mkdir()
    model = model_io.load(LM).model.eval()
    export_onnx(model, folder / "unpruned.onnx", (1, LM_SEQ_LEN))
    decode.export_decode(model, decode.decode_path(folder / "unpruned.onnx"))
    baseline = decode.decode_path(folder / "unpruned.onnx")
    fp32 = decode_timer([baseline], prompt_tokens=decode.PROMPT_TOKENS, threads=THREADS, batch=BATCH)[0]
    target = round(multiple * fp32["tokens_per_s"], 1)
    common = ["--seq-len", str(LM_SEQ_LEN), "--export", "onnx", "--deploy", "--calib-data", "text",
              "--deploy-threads", str(THREADS), "--deploy-batch", str(BATCH), "--no-latency"]
    common += ["--deploy-candidates", args.candidates] if args.candidates else []
    ways = []
    for way, extra in (("joint", ["--target-latency", f"{target}tok/s"]), ("b", [])):
        out = folder / way
        start = time.perf_counter()
        try:
            optkit(["optimize", LM, *extra, *common, "--out", str(out)])
        except RuntimeError as e:
            ways.append({"way": way, "error": str(e)})
            continue
        deploy = json.loads((out / "report.json").read_text(encoding="utf-8"))["deploy"]
        chosen = next(c for c in deploy["candidates"] if c["status"] == "chosen")
        step = out / next(name for name in deploy["files"] if ".decode" in name and not name.endswith(".data")
                          and not name.endswith(".bin"))
        frontier = (deploy.get("budget") or {}).get("points")
        ways.append({"way": way, "deployment": chosen["name"], "decode_path": step,
                     "perplexity": _perplexity(deploy, chosen, frontier), "frontier": frontier,
                     "candidates": [_token_candidate(c) for c in deploy["candidates"]],
                     "search_s": round(time.perf_counter() - start, 1)})
    timed = [w for w in ways if "error" not in w]
    speeds = decode_timer([baseline, *(w["decode_path"] for w in timed)], prompt_tokens=decode.PROMPT_TOKENS,
                          threads=THREADS, batch=BATCH)
    for way, speed in zip(timed, speeds[1:]):
        way.update(tokens_per_s=speed["tokens_per_s"], meets=speed["tokens_per_s"] >= target * (1 - TOLERANCE))
        way["decode_path"] = way["decode_path"].name
    return {"model": LM_NAME, "decode_target": multiple, "fp32_tokens_per_s": speeds[0]["tokens_per_s"],
            "target_tokens_per_s": target, "ways": ways}


def _token_candidate(candidate: dict) -> dict:
    """A token deployment as ``--deploy`` checked and timed it: decode speed-up over FP32, perplexity ratio."""
    check, latency = candidate.get("check") or {}, candidate.get("latency") or {}
    return {"name": candidate["name"], "status": candidate["status"], "speedup": candidate.get("speedup"),
            "tokens_per_s": latency.get("tokens_per_s"), "perplexity_ratio": check.get("perplexity_ratio"),
            "reason": candidate.get("reason")}


def _perplexity(deploy: dict, chosen: dict, frontier: list | None) -> float | None:
    """The chosen deployment's validation perplexity: the search's score, else its check's (an FP32 file's is the
    reference every other candidate's check gives)."""
    if frontier:
        return next(p["score"]["perplexity"] for p in frontier if p["status"] == "chosen")
    return chosen["check"].get("perplexity") or next(
        (c["check"]["perplexity_fp32"] for c in deploy["candidates"] if (c.get("check") or {}).get("perplexity_fp32")),
        None)


def to_markdown(report: dict) -> str:
    lines = ["# A latency budget in, the most accurate deployment out", "",
             f"`{report['command']}`, {report['date']}, {report['machine']}, load average {report['load_avg_at_start']}"
             f" at the start, {report.get('load_avg_at_end')} at the end; {THREADS} threads, batch {BATCH}; accuracy "
             f"on the first {report['config']['test_samples']} Fashion-MNIST test images, in each deployment's "
             "runtime. A way meets the budget when its time, measured again with the others (the median of "
             f"{report['config'].get('recheck_runs', 1)} interleaved run(s)), is within 5% of it."
             + (f" Every way's model fine-tuned {report['config']['finetune_steps']} steps of {FINETUNE_BATCH} "
                "Fashion-MNIST training images before it was deployed (the joint search's chosen one with "
                "`--finetune`, (a)'s pruned and (b)'s unpruned model with the same pass and seed)."
                if report["config"].get("finetune_steps") else ""),
             "", "| model | budget | way | deployment | MACs kept | ms (× unpruned FP32) | meets | accuracy | "
             "efficiency | search s |", "|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['budget_fraction']} | error: {row['error']} | | | | | | | |")
            continue
        for way in row["ways"]:
            label = {"joint": f"**joint** ({row['verdict']})", "a": "(a) prune, then deploy",
                     "b": "(b) quantization alone"}[way["way"]]
            if "error" in way:
                lines.append(f"| {row['model']} | {row['budget_fraction']} ({row['budget_ms']:.3g} ms) | {label} | "
                             f"refused: {way['error']} | | | | | | |")
                continue
            lines.append(f"| {row['model']} | {row['budget_fraction']} ({row['budget_ms']:.3g} ms) | {label} | "
                         f"{way['deployment']} | {way['macs_fraction']:.3f} | {way['ms']:.3g} ({way['fraction']:.3f}) | "
                         f"{'yes' if way['meets'] else 'no'} | {way['accuracy']:.2%} | "
                         f"{way.get('efficiency') or '–'} | {way.get('search_s', '–')} |")
    lines += _image_summary([r for r in report["rows"] if "error" not in r])
    if report.get("language"):
        lines += ["", "The shipped language model (decode tokens/s at 2 threads, batch 1, a step after a "
                  f"{LM_PROMPT_WORDS}; validation perplexity from each deployment's check; (a) is not defined for a "
                  "transformer: optkit's latency target is for conv/linear models):", "",
                  "| target | way | deployment | decode tokens/s (× FP32) | meets | validation perplexity | search s |",
                  "|---|---|---|---:|---|---:|---:|"]
        for row in report["language"]:
            if "error" in row:
                lines.append(f"| {row['decode_target']}x | error: {row['error']} | | | | | |")
                continue
            for way in row["ways"]:
                target = f"{row['decode_target']}x ({row['target_tokens_per_s']:.0f} tokens/s)"
                if "error" in way:
                    lines.append(f"| {target} | {way['way']} | error: {way['error']} | | | | |")
                    continue
                ratio = way["tokens_per_s"] / row["fp32_tokens_per_s"]
                perplexity = "–" if way["perplexity"] is None else f"{way['perplexity']:.3f}"
                label = {"joint": "**joint**", "b": "(b) --deploy alone"}[way["way"]]
                lines.append(f"| {target} | {label} | {way['deployment']} | {way['tokens_per_s']:.0f} "
                             f"({ratio:.2f}) | {'yes' if way['meets'] else 'no'} | {perplexity} | "
                             f"{way['search_s']} |")
        lines += _token_candidates(report["language"])
    return "\n".join(lines) + "\n"


def _image_summary(rows: list[dict]) -> list[str]:
    """How many image rows the joint search met, and on how many its accuracy was at least, or above, the best
    of the ways (a) and (b) that met the budget too."""
    if not rows:
        return []
    met = [r for r in rows if r["ways"][0].get("meets")]
    verdicts = [r["verdict"] for r in met]
    refused = [r["verdict"] for r in rows if "error" in r["ways"][0]]
    at_least = sum(v in ("better", "equal", "joint met it; neither (a) nor (b) did") for v in verdicts)
    return ["", f"The joint search met the budget, timed again, on {len(met)} of {len(rows)} rows; its accuracy was at "
            f"least the best of (a) and (b) that met it on {at_least} of them, higher on "
            f"{sum(v == 'better' for v in verdicts)}, and neither (a) nor (b) met the budget on "
            f"{sum(v.startswith('joint met it') for v in verdicts)}; it refused {len(refused)} row(s) as out of reach, "
            f"where (a) or (b) met the budget on {sum(v.endswith('met it') for v in refused)}."] + _margins(met)


def _margins(rows: list[dict]) -> list[str]:
    """Each met row's accuracy margin of the joint search over the best of (a) and (b) that met the budget, with
    the standard error of that difference on the test images: paired (from the images only one of the two gets
    right) where the row counted them, else as two independent binomial proportions. A margin under two of them is
    within what the test sample can tell apart."""
    lines = []
    for row in rows:
        joint_way, *others = row["ways"]
        meeting = [w for w in others if w.get("meets")]
        if not meeting:
            continue
        best = max(meeting, key=lambda w: w["accuracy"])
        n = row.get("test_samples") or 2000
        if "against_joint" in best:
            wins, losses = best["against_joint"]["joint_only_right"], best["against_joint"]["only_right"]
            error, kind = (((wins + losses) / n - ((wins - losses) / n) ** 2) / n) ** 0.5, "paired"
        else:
            error = ((joint_way["accuracy"] * (1 - joint_way["accuracy"]) + best["accuracy"] * (1 - best["accuracy"]))
                     / n) ** 0.5
            kind = "unpaired"
        lines.append(f"{row['model']} at {row['budget_fraction']}: {100 * (joint_way['accuracy'] - best['accuracy']):+.2f} "
                     f"points over ({best['way']}), standard error of the difference {100 * error:.2f} points ({kind})")
    return ["", "Margins of the joint search (test accuracy): " + "; ".join(lines) + "."] if lines else []


def _token_candidates(rows: list[dict]) -> list[str]:
    """Every deployment ``--deploy`` tried on the unpruned language model, and whether weight-only INT4 reached
    2x FP32 decode at 1.05x perplexity or less."""
    candidates = next((w["candidates"] for row in rows for w in row.get("ways", ())
                       if w["way"] == "b" and w.get("candidates")), None)
    if not candidates:
        return []
    lines = ["", "Every deployment of the unpruned model, as (b)'s ``--deploy`` checked and timed it (decode tokens/s "
             "in its timing run; perplexity over the FP32 ONNX file's on the validation text):", "",
             "| deployment | status | decode tokens/s | × FP32 | perplexity × FP32 | reason |",
             "|---|---|---:|---:|---:|---|"]
    def cell(value, spec):
        return "–" if value is None else format(value, spec)
    for c in candidates:
        lines.append(f"| {c['name']} | {c['status']} | {cell(c['tokens_per_s'], '.0f')} | {cell(c['speedup'], '.2f')} | "
                     f"{cell(c['perplexity_ratio'], '.4f')} | {(c['reason'] or '').replace('|', '/')} |")
    int4 = [c for c in candidates if c["name"].endswith("-w4") and c["speedup"] is not None]
    if int4:
        best = max(int4, key=lambda c: c["speedup"])
        met = best["speedup"] >= 2.0 and (best["perplexity_ratio"] or 0.0) <= 1.05
        lines += ["", f"Weight-only INT4: the fastest, {best['name']}, decodes at {best['speedup']:.2f}x FP32 with "
                  f"{cell(best['perplexity_ratio'], '.4f')}x its perplexity: the 2x at 1.05x target is "
                  f"{'met' if met else 'not met'}."]
    return lines


def plot(report: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in report["rows"] if "error" not in r]
    if not rows:
        return
    figure = Figure(figsize=(4 * len(rows), 3.5))
    FigureCanvasAgg(figure)
    for i, row in enumerate(rows, start=1):
        axes = figure.add_subplot(1, len(rows), i)
        for way, color in zip(row["ways"], ("tab:red", "tab:blue", "tab:green")):
            if "error" in way:
                continue
            axes.scatter(way["fraction"], way["accuracy"] * 100, color=color, label=f"{way['way']}: {way['deployment']}")
        axes.axvline(row["budget_fraction"], color="0.5", linestyle="--")
        axes.set_title(f"{row['model']}, budget {row['budget_fraction']}", fontsize=9)
        axes.set_xlabel("latency / unpruned FP32")
        axes.set_ylabel("test accuracy (%)")
        axes.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=90, format="png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated rows: fashion or torchvision names")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="comma-separated latency fractions")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per deployment in each timing run")
    parser.add_argument("--recheck-runs", type=int, default=3,
                        help="interleaved runs that time the three ways again after the search (the median counts)")
    parser.add_argument("--test-samples", type=int, default=2000, help="test images each way is scored on")
    parser.add_argument("--train-steps", type=int, default=300, help="training steps of the 224-px models")
    parser.add_argument("--finetune-steps", type=int, default=0,
                        help="fine-tune each way's model this many steps before it is deployed (0: none)")
    parser.add_argument("--candidates", default="", help="comma-separated deployments to try (default: all)")
    parser.add_argument("--no-language", action="store_true", help="skip the language-model rows")
    parser.add_argument("--lm-targets", default=",".join(map(str, LM_TARGETS)),
                        help="comma-separated decode targets, multiples of the FP32 tokens/s")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "optkit-bench" / "budget"),
                        help="where the 224-px models are trained once")
    parser.add_argument("--out", default=str(RESULTS / "budget"), help="output path without extension")
    args = parser.parse_args(argv)
    if args.recheck_runs < 1:
        parser.error("--recheck-runs must be at least 1")
    partial = partial_options(parser, args, ["models", "budgets", "repeats", "recheck_runs", "test_samples",
                                             "train_steps", "finetune_steps", "candidates", "no_language",
                                             "lm_targets"])
    out = destination(args.out, partial)
    report = {"command": "flock /tmp/optkit-bench.lock python benchmarks/budget.py "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)",
              "load_avg_at_start": [round(v, 2) for v in os.getloadavg()],
              "config": {"threads": THREADS, "batch": BATCH, "repeats": args.repeats, "recheck_runs": args.recheck_runs,
                         "test_samples": args.test_samples,
                         "train_steps": args.train_steps, "finetune_steps": args.finetune_steps}, "rows": []}
    # The language rows first: they are the shortest.
    if not args.no_language:
        report["language"] = []
        with tempfile.TemporaryDirectory(prefix="optkit-budget-lm-") as scratch:
            for multiple in (float(m) for m in args.lm_targets.split(",")):
                try:
                    report["language"].append(language_row(multiple, args, Path(scratch)))
                except Exception as e:  # one row's failure is a row of the report, not the end of the run
                    report["language"].append({"model": LM_NAME, "decode_target": multiple,
                                               "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(report["language"][-1], default=str), flush=True)
                write_results(report, out)
    with tempfile.TemporaryDirectory(prefix="optkit-budget-bench-") as scratch:
        for name in filter(None, args.models.split(",")):
            for fraction in (float(f) for f in args.budgets.split(",")):
                try:
                    report["rows"].append(run_row(name, fraction, args, Path(scratch)))
                except Exception as e:  # one row's failure is a row of the report, not the end of the run
                    report["rows"].append({"model": name, "budget_fraction": fraction,
                                           "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(report["rows"][-1], default=str), flush=True)
                # Written after every row, so an interrupted run keeps what it measured.
                write_results(report, out)
    report["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(report, out)


def write_results(report: dict, out: Path) -> None:
    write_text(Path(f"{out}.json"), json.dumps(report, indent=2, default=str) + "\n")
    write_text(Path(f"{out}.md"), to_markdown(report))
    plot(report, Path(f"{out}.png"))


if __name__ == "__main__":
    main()
