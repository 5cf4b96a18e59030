"""Structured pruning (ratio 0.3) on a model zoo: torchvision classification models, or a timm set.

Each model runs in its own subprocess under a memory cap and a time limit, so
one model that loops or blows up cannot hang or kill the run. For each model
the table records: ok or the error, MACs and params after / before, pruning
wall time, whether forward and backward run with the output shape unchanged,
and the layers left untouched (with reasons, in the JSON). The same run also
times pruning resnet50 with optkit against calling torch-pruning directly with
the same settings.

With ``--zoo timm`` it prunes a development set of timm architectures
(random weights, each at its default input size) and records, side by side,
what calling torch-pruning directly does (ok, error or hang, under the same
time limit), and per model the layers optkit held at full width and why.

Usage (timings matter, so hold the shared benchmark lock):

    flock /tmp/optkit-bench.lock python benchmarks/zoo.py
    flock /tmp/optkit-bench.lock python benchmarks/zoo.py --zoo timm

Writes benchmarks/results/zoo.{json,md} (torchvision) or zoo-timm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from _results import destination, partial_options, pin_lines

from optkit.passes.prune.passes import DEFAULT_ROUND_TO

RESULTS = Path(__file__).resolve().parent / "results"
RATIO = 0.3
MEMORY_CAP_GIB = 10.0
PRUNE_TIMEOUT_S = 240.0
# A worker also builds, measures and runs each model around its pruning.
PROCESS_SLACK_S = 180.0
COMPARE_REPEATS = 9
COMPARE = "compare:resnet50"
TIMM_PREFIX = "timm:"
DIRECT_TIMEOUT_S = 60.0
TIMM_MODELS = (
    "xcit_nano_12_p16_224 crossvit_tiny_240 pit_ti_224 convit_tiny visformer_tiny tnt_s_patch16_224 nest_tiny "
    "volo_d1_224 efficientvit_b0 efficientvit_m0 repvit_m0_9 tiny_vit_5m_224 maxvit_nano_rw_256 coatnet_nano_rw_224 "
    "davit_tiny focalnet_tiny_srf twins_svt_small swin_tiny_patch4_window7_224 hiera_tiny_224 eva02_tiny_patch14_224 "
    "caformer_s18 shvit_s1 swiftformer_xs fasternet_t0 starnet_s1 mambaout_femto hgnetv2_b0 ghostnetv2_100 "
    "repghostnet_100 spnasnet_100 hardcorenas_a semnasnet_075 fbnetv3_b xception41p tresnet_m sequencer2d_s "
    "gmlp_ti16_224 mixer_s16_224 resmlp_12_224 halonet26t lambda_resnet26t cs3darknet_s darknet17 gcresnet33ts "
    "vovnet39a legacy_seresnet18 inception_next_atto"
).split()


def input_shape(name: str, size: int) -> tuple[int, int, int, int]:
    """``size`` x ``size``, except for models whose input size is fixed (ViT, MaxViT: 224)."""
    fixed = name.startswith("vit_") or name == "maxvit_t"
    return (1, 3, 224, 224) if fixed else (1, 3, size, size)


def run_model(name: str, size: int, time_limit: float) -> dict:
    """Prune one model and check it (runs inside the worker subprocess)."""
    import torch

    from optkit.io.models import load_model
    from optkit.model.stats import count_macs, count_params
    from optkit.passes.prune.passes import StructuredPrune

    torch.manual_seed(0)
    shape = input_shape(name, size)
    model = load_model(f"torchvision:{name}")
    macs0, params0 = count_macs(model, shape), count_params(model)
    start = time.perf_counter()
    result = StructuredPrune(ratio=RATIO, input_shape=shape, timeout_s=time_limit).apply(model)
    seconds = time.perf_counter() - start
    macs1, params1 = count_macs(model, shape), count_params(model)
    model.train()
    out = model(torch.randn(*shape))
    out.float().sum().backward()
    skipped = result.details["skipped_layers"]
    return {
        "model": name, "status": "ok", "input_shape": list(shape),
        "macs_before": macs0, "macs_after": macs1, "macs_ratio": round(macs1 / macs0, 4),
        "params_before": params0, "params_after": params1, "params_ratio": round(params1 / params0, 4),
        "prune_seconds": round(seconds, 3), "output_shape": list(out.shape),
        "output_shape_ok": list(out.shape) == [shape[0], 1000], "backward_ok": True,
        "skipped_count": len(skipped), "skipped_layers": skipped,
    }


def run_timm_model(name: str, time_limit: float) -> dict:
    """Prune one timm model with optkit and with torch-pruning directly (runs inside the worker subprocess)."""
    import timm
    import torch

    from optkit.model.stats import count_macs, count_params
    from optkit.passes.prune.passes import StructuredPrune

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    shape = (1, *model.pretrained_cfg["input_size"])
    direct = direct_timm(name, shape, min(time_limit, DIRECT_TIMEOUT_S))
    macs0, params0 = count_macs(model, shape), count_params(model)
    reference = model.eval()(torch.randn(*shape)).shape
    start = time.perf_counter()
    details = StructuredPrune(ratio=RATIO, input_shape=shape, timeout_s=time_limit).apply(model).details
    seconds = time.perf_counter() - start
    macs1, params1 = count_macs(model, shape), count_params(model)
    model.train()
    out = model(torch.randn(2, *shape[1:]))
    out.float().sum().backward()
    held = details.get("held_layers", {})
    return {
        "model": name, "status": "ok", "input_shape": list(shape),
        "macs_ratio": round(macs1 / macs0, 4), "params_ratio": round(params1 / params0, 4),
        "prune_seconds": round(seconds, 2), "output_shape_ok": out.shape[1:] == reference[1:], "backward_ok": True,
        "held_count": len(held), "held_layers": held, "shortfall": details.get("shortfall"),
        "fallback": details.get("fallback"), "skipped_count": len(details["skipped_layers"]),
        "skipped_layers": details["skipped_layers"], "direct": direct,
    }


def direct_timm(name: str, shape: tuple[int, ...], limit: float) -> dict:
    """What calling torch-pruning directly does on a fresh copy: ok (runs after), error, or hang."""
    import timm
    import torch
    import torch_pruning as tp

    from optkit.passes.prune.graph.limits import TimeLimitExceeded, time_limit

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    example = torch.randn(*shape)
    reference = model(example).shape
    head = model.get_classifier()
    start = time.perf_counter()
    try:
        with time_limit(limit):
            pruner = tp.pruner.BasePruner(model, example, importance=tp.importance.GroupMagnitudeImportance(p=1),
                                          pruning_ratio=RATIO, round_to=8,
                                          ignored_layers=[head] if isinstance(head, torch.nn.Module) else [])
            pruner.step()
            out = model(example)
            out.float().sum().backward()
        status = "ok" if out.shape == reference else "output shape changed"
        return {"status": status, "seconds": round(time.perf_counter() - start, 2)}
    except TimeLimitExceeded:
        return {"status": "hang", "error": f"no result within {limit:g} s"}
    except Exception as e:  # its failure is the measurement
        return {"status": "error", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"}


def compare_resnet50() -> dict:
    """Median wall time of pruning resnet50 at 0.3: optkit vs torch-pruning called directly."""
    import torch
    import torch_pruning as tp
    import torchvision

    from optkit.passes.prune.passes import StructuredPrune

    shape = (1, 3, 224, 224)

    def direct(model):
        example = torch.randn(*shape)
        pruner = tp.pruner.BasePruner(model, example, importance=tp.importance.GroupMagnitudeImportance(p=1),
                                      pruning_ratio=RATIO, ignored_layers=[model.fc], round_to=8)
        pruner.step()

    def optkit(model):
        StructuredPrune(ratio=RATIO, round_to=8, input_shape=shape).apply(model)

    import gc

    times: dict[str, list[float]] = {"optkit": [], "torch_pruning": []}
    # One untimed run of each first: the first prune in a process pays for imports and allocator growth.
    for repeat in range(COMPARE_REPEATS + 1):
        for label, fn in (("torch_pruning", direct), ("optkit", optkit)):
            model = torchvision.models.resnet50()
            gc.collect()
            start = time.perf_counter()
            fn(model)
            if repeat:
                times[label].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"repeats": COMPARE_REPEATS, "seconds": times, "median_s": medians,
            "min_s": {k: min(v) for k, v in times.items()},
            "optkit_over_direct": round(medians["optkit"] / medians["torch_pruning"], 3)}


def worker(args: argparse.Namespace) -> None:
    """Run tasks in order, printing one ``RESULT`` line each (runs inside the worker subprocess)."""
    import gc

    cap = int(args.memory_cap_gib * 1024**3)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for task in args.worker:
        try:
            if task == COMPARE:
                result = compare_resnet50()
            elif task.startswith(TIMM_PREFIX):
                result = run_timm_model(task[len(TIMM_PREFIX):], args.time_limit)
            else:
                result = run_model(task, args.size, args.time_limit)
        except Exception as e:  # one model's failure is a result, not the end of the run
            result = {"model": task, "status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("RESULT " + json.dumps(result), flush=True)
        gc.collect()


def run_all(tasks: list[str], on_result, args: argparse.Namespace) -> list[dict]:
    """Run tasks in a worker subprocess, restarting it after a crash or a model that overruns its limit."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    results: list[dict] = []
    pending = list(tasks)
    process_timeout = args.time_limit + PROCESS_SLACK_S
    while pending:
        proc = subprocess.Popen([sys.executable, __file__, "--size", str(args.size), "--time-limit", str(args.time_limit),
                                 "--memory-cap-gib", str(args.memory_cap_gib), "--worker", *pending],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        os.set_blocking(proc.stdout.fileno(), False)
        deadline, buffer = time.monotonic() + process_timeout, ""
        while pending:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = proc.stdout.read() if ready else None
            if ready and chunk:
                buffer += chunk
                while "\n" in buffer:
                    line, buffer = buffer.split("\n", 1)
                    if line.startswith("RESULT "):
                        results.append(json.loads(line[len("RESULT "):]))
                        if "model" in results[-1]:
                            results[-1]["model"] = results[-1]["model"].removeprefix(TIMM_PREFIX)
                        on_result(results[-1])
                        pending.pop(0)
                        deadline = time.monotonic() + process_timeout
                continue
            if ready and proc.poll() is None:
                continue
            proc.kill()
            stderr = proc.communicate()[1]
            why = (f"no result within {process_timeout:g} s" if proc.returncode == -9 and not ready
                   else (stderr.strip().splitlines() or [f"worker exited with code {proc.returncode}"])[-1][:300])
            results.append({"model": pending.pop(0).removeprefix(TIMM_PREFIX), "status": "error", "error": why})
            on_result(results[-1])
            break
        else:
            proc.wait()
    return results


def markdown(data: dict) -> str:
    rows = data["models"]
    ok = [r for r in rows if r["status"] == "ok"]
    pending = data.get("pending") or []
    passing = [r for r in ok if r["macs_ratio"] <= 0.75 and r["output_shape_ok"] and r["backward_ok"]]
    cmp_ = data["resnet50_compare"]
    lines = [
        "# Structured pruning on the torchvision zoo",
        "",
        f"Command: `{data['command']}`",
        "",
        *pin_lines("torch-pruning", data.get("torch_pruning")),
        *([data["note"], ""] if data.get("note") else []),
        f"Machine: {data['machine']}; torch {data['torch']}, torchvision {data['torchvision']}, "
        f"torch-pruning {data['torch_pruning']}. Random-init weights, ratio {RATIO}, optkit's default round_to "
        f"({DEFAULT_ROUND_TO}), L1 importance, "
        f"input {data['size']}x{data['size']} (ViT and MaxViT: 224x224, fixed by the models); MACs counted at that input. "
        f"Models run in worker subprocesses ({data['memory_cap_gib']:g} GiB address-space cap, a "
        f"{data['time_limit_s']:g} s pruning time limit per model) that are restarted after a crash or an overrun.",
        "",
        f"**{len(passing)} of {len(rows) + len(pending)}** models prune, run forward and backward with the output shape "
        "unchanged, and reach a MACs ratio of at most 0.75.",
        "",
    ]
    if "optkit_over_direct" in cmp_:
        med = cmp_["median_s"]
        rerun = f"; measured again alone with `{cmp_['command']}`" if "command" in cmp_ else ""
        lines += [f"resnet50 pruning time (median of {cmp_['repeats']} interleaved runs after one warm-up run each"
                  f"{rerun}): optkit {med['optkit']:.3f} s, torch-pruning directly {med['torch_pruning']:.3f} s: "
                  f"**{cmp_['optkit_over_direct']:.2f}x**.", ""]
    else:
        lines += [f"resnet50 comparison failed: {cmp_.get('error')}", ""]
    lines += ["| model | result | MACs after/before | params after/before | prune s | skipped layers |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | error: {r['error']} | | | | |")
            continue
        result = "ok" if r["output_shape_ok"] and r["backward_ok"] else "output shape changed"
        skipped = _skipped_summary(r["skipped_layers"])
        lines.append(f"| {r['model']} | {result} | {r['macs_ratio']:.3f} | {r['params_ratio']:.3f} | "
                     f"{r['prune_seconds']:.2f} | {skipped} |")
    if pending:
        lines += ["", f"Not run (the run was cut short): {', '.join(pending)}."]
    lines += ["", "Skipped layers keep their width; the JSON lists each with its reason."]
    return "\n".join(lines) + "\n"


def _skipped_summary(skipped: dict[str, str]) -> str:
    if not skipped:
        return "none"
    reasons: dict[str, int] = {}
    for reason in skipped.values():
        # "same structure as X, which caused: Error: ..." counts under the error it repeats.
        cause = reason.split("caused: ", 1)[-1].split("failed: ", 1)[-1] if reason.startswith("same structure") else reason
        key = cause.split(":")[0].split(" (")[0]
        reasons[key] = reasons.get(key, 0) + 1
    return "; ".join(f"{n} × {reason}" for reason, n in reasons.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--zoo", choices=("torchvision", "timm"), default="torchvision",
                        help="which zoo: torchvision classification models, or the timm development set")
    parser.add_argument("--models", nargs="*", help="only these models (default: the whole zoo)")
    parser.add_argument("--size", type=int, default=224, help="input height and width (ViT and MaxViT always use 224)")
    parser.add_argument("--parallel", type=int, default=1, help="worker subprocesses running models at once")
    parser.add_argument("--time-limit", type=float, default=PRUNE_TIMEOUT_S, help="seconds each model may spend pruning")
    parser.add_argument("--memory-cap-gib", type=float, default=MEMORY_CAP_GIB,
                        help="address-space cap of each worker subprocess")
    parser.add_argument("--note", default="", help="a remark on the run conditions, written into zoo.md")
    parser.add_argument("--compare-only", action="store_true",
                        help="rerun only the resnet50 timing comparison and update zoo.json and zoo.md with it")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # Some models, or another size, than the committed tables: written elsewhere (see _results.py).
    args.results = destination(RESULTS, partial_options(parser, args, ["models", "size"]))
    if args.compare_only:
        rerun_comparison(args)
        return

    if args.zoo == "timm":
        run_timm_zoo(args)
        return

    import torch
    import torch_pruning
    import torchvision

    names = args.models or sorted(torchvision.models.list_models(module=torchvision.models), key=_cost)
    started = time.perf_counter()
    command = "python " + " ".join(["benchmarks/zoo.py", *sys.argv[1:]])
    data = {
        "command": command, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__, "torchvision": torchvision.__version__, "torch_pruning": torch_pruning.__version__,
        "note": args.note, "ratio": RATIO, "size": args.size, "time_limit_s": args.time_limit,
        "memory_cap_gib": args.memory_cap_gib, "resnet50_compare": {}, "models": [], "pending": list(names),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        data["total_seconds"] = round(time.perf_counter() - started, 1)
        write_results(data, args.results)

    # The timing comparison runs first, before the run heats up or is cut short.
    data["resnet50_compare"] = run_all([COMPARE], lambda row: None, args)[0]
    print(f"resnet50 optkit/direct: {data['resnet50_compare'].get('optkit_over_direct')}", flush=True)

    lock = threading.Lock()

    def report(row: dict) -> None:
        with lock:
            data["models"].append(row)
            data["pending"].remove(row["model"])
            data["models"].sort(key=lambda r: r["model"])
            save()
        summary = (f"macs {row['macs_ratio']:.3f} in {row['prune_seconds']:.1f} s" if row["status"] == "ok"
                   else f"error: {row['error']}")
        print(f"[{len(data['models'])}/{len(names)}] {row['model']}: {summary}", flush=True)

    shares = [names[i::args.parallel] for i in range(args.parallel)]
    threads = [threading.Thread(target=run_all, args=(share, report, args)) for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    save()


def run_timm_zoo(args: argparse.Namespace) -> None:
    """Prune the timm set one model at a time, saving zoo-timm.{json,md} after each."""
    import timm
    import torch
    import torch_pruning

    from optkit.core.files import write_text

    names = args.models or list(TIMM_MODELS)
    started = time.perf_counter()
    data = {
        "command": "python " + " ".join(["benchmarks/zoo.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
        "timm": timm.__version__, "torch_pruning": torch_pruning.__version__, "note": args.note, "ratio": RATIO,
        "time_limit_s": args.time_limit, "direct_time_limit_s": min(args.time_limit, DIRECT_TIMEOUT_S),
        "memory_cap_gib": args.memory_cap_gib, "models": [], "pending": list(names),
    }

    def report(row: dict) -> None:
        data["models"].append(row)
        data["pending"].remove(row["model"])
        data["total_seconds"] = round(time.perf_counter() - started, 1)
        args.results.mkdir(parents=True, exist_ok=True)
        write_text(args.results / "zoo-timm.json", json.dumps(data, indent=1) + "\n")
        write_text(args.results / "zoo-timm.md", timm_markdown(data))
        summary = (f"macs {row['macs_ratio']:.3f}, {row['held_count']} held, {row['prune_seconds']:.1f} s, "
                   f"direct {row['direct']['status']}" if row["status"] == "ok" else f"error: {row['error']}")
        print(f"[{len(data['models'])}/{len(names)}] {row['model']}: {summary}", flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    run_all([TIMM_PREFIX + name for name in names], report, args)


def timm_markdown(data: dict) -> str:
    rows = data["models"]
    ok = [r for r in rows if r["status"] == "ok" and r["output_shape_ok"] and r["backward_ok"]]
    reached = [r for r in ok if r["macs_ratio"] <= 0.75]
    direct_ok = [r for r in rows if r.get("direct", {}).get("status") == "ok"]
    total = len(rows) + len(data["pending"])
    lines = [
        "# Structured pruning on a timm development set",
        "",
        f"Command: `{data['command']}`",
        "",
        *pin_lines("torch-pruning", data.get("torch_pruning")),
        *([data["note"], ""] if data.get("note") else []),
        f"Machine: {data['machine']}; torch {data['torch']}, timm {data['timm']}, torch-pruning "
        f"{data['torch_pruning']}. Random-init weights (`pretrained=False`), each model at its default input size, "
        f"ratio {RATIO}, optkit's default round_to ({DEFAULT_ROUND_TO}), L1 importance, optkit's default limits (a "
        f"{data['time_limit_s']:g} s limit per try). "
        f"torch-pruning called directly: `BasePruner` with the classifier ignored, the same ratio, round_to 8, "
        f"a {data['direct_time_limit_s']:g} s limit; ok means it finished and the model then ran forward and "
        "backward with the same output shape.",
        "",
        f"optkit: **{len(ok)} of {total}** prune and run (forward, backward, output shape unchanged); "
        f"**{len(reached)}** reach a MACs ratio of at most 0.75. torch-pruning directly: {len(direct_ok)} of "
        f"{len(rows)} run.",
        "",
        "| model | optkit | MACs after/before | params after/before | held layers | prune s (trials) | "
        "torch-pruning directly |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | error: {r['error']} | | | | | |")
            continue
        result = "ok" if r["output_shape_ok"] and r["backward_ok"] else "output shape changed"
        direct = r["direct"]["status"] + (f": {r['direct']['error']}" if "error" in r["direct"] else "")
        trials = (r.get("fallback") or {}).get("trials", 1)
        lines.append(f"| {r['model']} | {result} | {r['macs_ratio']:.3f} | {r['params_ratio']:.3f} | "
                     f"{r['held_count']}: {_skipped_summary(r['held_layers'])} | {r['prune_seconds']:.1f} ({trials}) | "
                     f"{direct.replace('|', '/')} |")
    if data["pending"]:
        lines += ["", f"Not run (the run was cut short): {', '.join(data['pending'])}."]
    lines += ["", "Held layers are group roots the fallback kept at full width, each with the error pruning it "
              "caused (the JSON has every one, and all skipped layers)."]
    return "\n".join(lines) + "\n"


def rerun_comparison(args: argparse.Namespace) -> None:
    """Replace the resnet50 comparison in an existing zoo.json (a quiet rerun of the timing alone)."""
    data = json.loads((RESULTS / "zoo.json").read_text())
    data["resnet50_compare"] = run_all([COMPARE], lambda row: None, args)[0]
    data["resnet50_compare"]["command"] = "python " + " ".join(["benchmarks/zoo.py", *sys.argv[1:]])
    print(f"resnet50 optkit/direct: {data['resnet50_compare'].get('optkit_over_direct')}", flush=True)
    write_results(data)


def write_results(data: dict, folder: Path = RESULTS) -> None:
    """Write zoo.json and zoo.md (atomically, so an interrupted run keeps the last complete pair)."""
    from optkit.core.files import write_text

    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "zoo.json", json.dumps(data, indent=1) + "\n")
    write_text(folder / "zoo.md", markdown(data))


def _cost(name: str) -> tuple[int, str]:
    # Run the largest models last (rough size classes from the name), so a cut-short run covers the most models.
    heavy = ("vit_h", "regnet_y_128", "vit_l", "regnet_y_32", "regnet_y_16", "efficientnet_b7", "swin_v2_b",
             "efficientnet_v2_l", "regnet_x_32", "vgg19", "vgg16", "convnext_large")
    rank = next((i for i, h in enumerate(reversed(heavy), 1) if name.startswith(h)), 0)
    return rank, name


if __name__ == "__main__":
    main()
