"""Pruning to a measured latency target against pruning to a MACs target at the same measured latency.

For each model at 224x224, 2 threads, batch 1: ``StructuredPrune(target_latency=0.5)`` (the per-layer
latency table, three proposals timed and corrected, the most MACs per measured latency kept), then
``StructuredPrune(target_macs=...)`` at up to ``MACS_TRIES`` MACs fractions, each timed in alternating
blocks (with :func:`optkit.analysis.latency.interleaved_latency`) against the original and the
latency-target model. Each try's latency relative to the latency-target model's in the same timing run
(robust to a change of machine load between tries) steers the next MACs fraction (secant steps), and the
MACs fraction at equal measured latency is interpolated between the two tries nearest to it (bracketing
it where the tries do), or, from a try within 2% of it, is that try's MACs scaled by its relative
latency. A try with the same parameter shapes as the latency-target model is the same network: its
relative latency is 1 by definition (timing the same network twice differs by up to 7% on a small model
here). The latency target "keeps at least as many MACs" when its MACs fraction is at least
that. The latency table is built twice (cold cache, then cached) to record both costs.

Run (timings only mean something when nothing else heavy runs; other benchmarks take the same lock)::

    flock /tmp/optkit-bench.lock python benchmarks/latency_target.py
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

import torchvision

from optkit.analysis.latency import cpu_model, interleaved_latency
from _results import destination, partial_options

from optkit.core.files import write_text
from optkit.export.onnx import export_onnx
from optkit.model.stats import count_macs
from optkit.passes.prune.passes import StructuredPrune
from optkit.passes.prune.targets.latency_table import build_table

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
TARGET = 0.5
THREADS = 2
BATCH = 1
INPUT_SHAPE = (1, 3, 224, 224)
MACS_TRIES = 4
#: Timed calls per file in each comparison (blocks of 2: 30 fresh sessions per file).
REPEATS = 60
#: Tries whose latency is within this fraction of the latency-target model's count as equal.
EQUAL_LATENCY_TOLERANCE = 0.02
#: How far past the nearest try the next one goes when the secant would repeat a try.
REPEAT_STEP = 0.02
RESULTS = Path(__file__).parent / "results"


def _measure(models: list, folder: str) -> list[float]:
    """Median ms of each model in ONNX Runtime, timed in alternation."""
    paths = []
    for i, model in enumerate(models):
        path = os.path.join(folder, f"m{i}.onnx")
        export_onnx(model, path, INPUT_SHAPE, dynamic_batch=False)
        paths.append(path)
    return [r.median_ms for r in interleaved_latency(paths, INPUT_SHAPE, threads=THREADS, repeats=REPEATS)]


def run_model(name: str, cache: str) -> dict:
    """One model's row: the latency-target prune and the MACs-target prune at the same measured latency."""
    os.environ["OPTKIT_CACHE_DIR"] = cache
    model = torchvision.models.get_model(name).eval()
    macs = count_macs(model, INPUT_SHAPE)
    first = build_table(model, INPUT_SHAPE, threads=THREADS, batch=BATCH).cost
    cached = build_table(model, INPUT_SHAPE, threads=THREADS, batch=BATCH).cost
    start = time.perf_counter()
    latency = StructuredPrune(target_latency=TARGET, input_shape=INPUT_SHAPE, latency_threads=THREADS,
                              latency_batch=BATCH).apply(copy.deepcopy(model))
    latency_s = time.perf_counter() - start
    goal = latency.details["measured_fraction"]
    macs_target = latency.details["macs_fraction"]
    tries: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="optkit-latency-bench-") as folder:
        for _ in range(MACS_TRIES):
            pruned = StructuredPrune(target_macs=macs_target, input_shape=INPUT_SHAPE).apply(copy.deepcopy(model))
            base, lat_ms, macs_ms = _measure([model, latency.model, pruned.model], folder)
            same = _shapes(pruned.model) == _shapes(latency.model)
            tries.append({"target_macs": macs_target, "macs_fraction": round(count_macs(pruned.model, INPUT_SHAPE) / macs, 4),
                          "measured_fraction": round(macs_ms / base, 4), "latency_ref": round(lat_ms / base, 4),
                          "relative": 1.0 if same else round(macs_ms / lat_ms, 4), "same_shapes": same})
            if abs(tries[-1]["relative"] - 1) <= EQUAL_LATENCY_TOLERANCE:
                break
            macs_target = _next_macs(tries)
    d = latency.details
    equal, how = _macs_at_equal_latency(tries)
    return {"model": name, "target_latency": TARGET,
            "latency_target": {"predicted_fraction": d["predicted_fraction"], "measured_fraction": goal,
                               "macs_fraction": d["macs_fraction"], "round_to": d["round_to"],
                               "proposal": d["proposal"],
                               "tries": d["tries"], "seconds": round(latency_s, 1)},
            "macs_target": {"tries": tries, "macs_at_equal_latency": round(equal, 4), "estimate": how,
                            "latency_ref": round(statistics.median(t["latency_ref"] for t in tries), 4)},
            "lut_first": first, "lut_cached": cached}


def _shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's name and shape: two prunes of one model with equal shapes are the same network."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _nearest_pair(tries: list[dict]) -> tuple[dict, dict, bool]:
    """The two tries nearest to equal latency (relative 1): the tightest bracket in MACs when the tries bracket it."""
    below = [t for t in tries if t["relative"] <= 1]
    above = [t for t in tries if t["relative"] > 1]
    if below and above:
        return max(below, key=lambda t: t["macs_fraction"]), min(above, key=lambda t: t["macs_fraction"]), True
    first, second = sorted(tries, key=lambda t: abs(t["relative"] - 1))[:2]
    return first, second, False


def _secant(a: dict, b: dict) -> float | None:
    """MACs fraction where the line through two tries (relative latency -> MACs fraction) reaches relative 1."""
    if a["relative"] == b["relative"]:
        return None
    slope = (b["macs_fraction"] - a["macs_fraction"]) / (b["relative"] - a["relative"])
    return a["macs_fraction"] + slope * (1 - a["relative"])


def _next_macs(tries: list[dict]) -> float:
    """The next MACs fraction to try: proportional after one try (latency taken as MACs-proportional), secant after.

    A guess already tried (latency is step-shaped in MACs, so the secant can return to a step) is replaced
    by the midpoint of the bracketing tries, or by a step past the nearest try when nothing brackets.
    """
    guess = None
    if len(tries) >= 2:
        guess = _secant(*_nearest_pair(tries)[:2])
    if guess is None:
        guess = tries[-1]["macs_fraction"] / tries[-1]["relative"]
    guess = round(min(0.95, max(0.05, guess)), 4)
    if any(abs(guess - t["target_macs"]) < 1e-3 for t in tries):
        a, b, bracketed = _nearest_pair(tries)
        if bracketed:
            guess = (a["macs_fraction"] + b["macs_fraction"]) / 2
        else:
            guess = a["macs_fraction"] + (REPEAT_STEP if a["relative"] < 1 else -REPEAT_STEP)
    return round(min(0.95, max(0.05, guess)), 4)


def _macs_at_equal_latency(tries: list[dict]) -> tuple[float, str]:
    """The MACs-target path's MACs fraction at the latency-target model's measured latency, and how it was found.

    A try within :data:`EQUAL_LATENCY_TOLERANCE` of equal latency gives its MACs scaled by its relative
    latency (latency taken as proportional to MACs over that small step), so a try 1% slower with 0.1% more
    MACs does not count as keeping more; otherwise the tries nearest to equal latency are interpolated.
    """
    nearest = min(tries, key=lambda t: abs(t["relative"] - 1))
    if abs(nearest["relative"] - 1) <= EQUAL_LATENCY_TOLERANCE or len(tries) < 2:
        return nearest["macs_fraction"] / nearest["relative"], "measured"
    a, b, bracketed = _nearest_pair(tries)
    value = _secant(a, b)
    if value is None:
        return nearest["macs_fraction"] / nearest["relative"], "measured"
    return value, "interpolated" if bracketed else "extrapolated"


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Latency target {TARGET} vs MACs target at the same measured latency", "",
             f"`{meta['command']}`, {meta['date']}, {meta['cpu']}, load average before {meta['load_before']}, "
             f"after {meta['load_after']}; {THREADS} threads, batch {BATCH}, input {INPUT_SHAPE}.", "",
             "| model | proposal kept (search s) | predicted | measured (search) | measured (re-timed) | "
             "MACs kept (latency) | MACs kept (MACs target, equal latency) | MACs-target tries (MACs: latency vs the latency-target model) "
             "| LUT first s (measurements) | LUT cached s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} | | | | | | | | |")
            continue
        lt, mt = r["latency_target"], r["macs_target"]
        tries = ", ".join(f"{t['macs_fraction']:.3f}: {t['relative']:.3f}" for t in mt["tries"])
        lines.append(f"| {r['model']} | {lt['proposal']} ({lt['seconds']:.0f}) | {lt['predicted_fraction']:.3f} | "
                     f"{lt['measured_fraction']:.3f} | {mt['latency_ref']:.3f} | {lt['macs_fraction']:.3f} | {mt['macs_at_equal_latency']:.3f} "
                     f"({mt['estimate']}) | {tries} | "
                     f"{r['lut_first']['seconds']:.1f} ({r['lut_first']['measurements']}) | "
                     f"{r['lut_cached']['seconds']:.2f} |")
    done = [r for r in rows if "error" not in r]
    if done:
        measured = statistics.median(r["latency_target"]["measured_fraction"] for r in done)
        retimed = statistics.median(r["macs_target"]["latency_ref"] for r in done)
        margins = [r["latency_target"]["macs_fraction"] - r["macs_target"]["macs_at_equal_latency"] for r in done]
        keeps = sum(m >= 0 for m in margins)
        lines += ["", f"Median measured fraction: {measured:.3f} in the search, {retimed:.3f} re-timed "
                  f"(target {TARGET} ± 0.05). The latency target keeps at least as many MACs as the MACs target at "
                  f"the same measured latency on {keeps} of {len(done)} models; MACs kept minus the MACs target's, "
                  f"per model: {', '.join(f'{m:+.3f}' for m in margins)} (median {statistics.median(margins):+.3f}). "
                  "A try within 2% of the latency-target model's latency counts as equal latency, its MACs "
                  "scaled by its relative latency."]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the models and write ``results/latency_target.json`` and ``.md`` (or ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", default=str(RESULTS / "latency_target"), help="output path without extension")
    parser.add_argument("--render", action="store_true", help="only recompute the equal-latency MACs from the "
                        "recorded tries and rewrite the --out files")
    args = parser.parse_args()
    # Fewer models, settings or repeats than the committed run: written elsewhere (see _results.py).
    partial = partial_options(parser, args, ["models"])
    args.out = str(destination(args.out, partial))
    if args.render:
        saved = json.loads(Path(f"{args.out}.json").read_text(encoding="utf-8"))
        for row in saved["rows"]:
            if "error" not in row:
                equal, how = _macs_at_equal_latency(row["macs_target"]["tries"])
                row["macs_target"].update(macs_at_equal_latency=round(equal, 4), estimate=how)
        write_text(Path(f"{args.out}.json"), json.dumps(saved, indent=2))
        write_text(Path(f"{args.out}.md"), _markdown(saved["rows"], saved["meta"]))
        return
    meta = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "cpu": f"{cpu_model()} ({os.cpu_count()} CPUs)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_before": [round(v, 2) for v in os.getloadavg()]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="optkit-lut-cache-") as cache:
        for name in args.models:
            try:
                rows.append(run_model(name, cache))
            except Exception as e:  # one model's failure is a row of the report, not the end of the run
                rows.append({"model": name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    meta["load_after"] = [round(v, 2) for v in os.getloadavg()]
    write_text(Path(f"{args.out}.json"), json.dumps({"meta": meta, "rows": rows}, indent=2))
    write_text(Path(f"{args.out}.md"), _markdown(rows, meta))


if __name__ == "__main__":
    main()
