"""``optkit optimize`` end to end on the timm development set, the way a user runs it.

For each model the user's side is played out in full:

1. a wrapper module is written (``class Model(nn.Module)`` whose constructor
   calls ``timm.create_model(NAME, pretrained=False)``) and the model's
   ``state_dict`` is saved with ``torch.save`` (weight matrices timm
   initializes to all zeros get small random values first, so no output is
   constant);
2. ``optkit optimize model.pt --arch MODULE:Model --input-shape ... --prune 0.3
   --export onnx --out DIR`` runs as a subprocess under a time limit;
3. independently of optkit's own checks, the saved ``model.pt`` is reloaded
   (``optkit.io.models.load_model`` with the same ``--arch``), run forward and
   backward in train mode at batch 2, its output shape compared with the
   original model's, and ``model.onnx`` run in ONNX Runtime on a fresh random
   input and compared with the reloaded model (largest difference at most
   1e-3 of the largest output magnitude, and the same top-1 class).

Usage (no timing is compared, so it may share the machine with one-thread work):

    OMP_NUM_THREADS=1 python benchmarks/timm_cli.py --cli-arg=--no-latency
    python benchmarks/timm_cli.py --models fasternet_t0 hiera_tiny_224   # rerun some, keep the others

Writes benchmarks/results/timm-cli.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zoo import RATIO, TIMM_MODELS

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
TIME_LIMIT_S = 600.0
ONNX_RTOL = 1e-3
# timm zero-initializes some weight matrices (classifier heads of MLP models among them); an all-zero head
# makes every output 0 and the parity check empty, so such matrices get small random values before saving.
ZERO_INIT_STD = 0.02
WRAPPER = '''import timm
from torch import nn


class Model(nn.Module):
    """{name} from timm, random weights, as a user's own importable class."""

    def __init__(self):
        super().__init__()
        self.net = timm.create_model("{name}", pretrained=False)

    def forward(self, x):
        return self.net(x)
'''


def run_one(name: str, work: Path, time_limit: float, cli_args: list[str]) -> dict:
    """Prepare the user's files, run the CLI, and check what it wrote."""
    import torch

    module = f"user_{name.replace('-', '_')}"
    (work / f"{module}.py").write_text(WRAPPER.format(name=name))
    sys.path.insert(0, str(work))
    try:
        wrapper = __import__(module).Model
        torch.manual_seed(0)
        original = wrapper().eval()
        with torch.no_grad():
            for parameter in original.parameters():
                if parameter.dim() >= 2 and not parameter.any():
                    parameter.normal_(0.0, ZERO_INIT_STD)
        shape = (1, *original.net.pretrained_cfg["input_size"])
        with torch.no_grad():
            reference_shape = list(original(torch.randn(*shape)).shape[1:])
        torch.save(original.state_dict(), work / "model.pt")
        del original
        out = work / "out"
        command = [sys.executable, "-m", "optkit", "optimize", str(work / "model.pt"), "--arch", f"{module}:Model",
                   "--input-shape", ",".join(map(str, shape)), "--prune", str(RATIO), "--export", "onnx",
                   "--out", str(out), *cli_args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), str(REPO), os.environ.get("PYTHONPATH", "")]))
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=time_limit, env=env)
        except subprocess.TimeoutExpired:
            return {"model": name, "status": "timeout", "error": f"no exit within {time_limit:g} s"}
        seconds = round(time.perf_counter() - start, 1)
        row = {"model": name, "input_shape": list(shape), "exit_code": proc.returncode, "cli_seconds": seconds}
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            return {**row, "status": "error", "error": (last or ["(no output)"])[-1][:300]}
        row.update(_report_figures(out / "report.json"))
        row.update(_check_outputs(out, f"{module}:Model", shape, reference_shape))
        row["status"] = "ok" if row["reload_ok"] and row["onnx_ok"] else "check failed"
        return row
    finally:
        sys.path.remove(str(work))
        sys.modules.pop(module, None)


def _report_figures(path: Path) -> dict:
    report = json.loads(path.read_text())
    held = [layer for entry in report["passes"] for layer in entry.get("details", {}).get("held_layers", {})]
    return {"macs_ratio": round(report["ratios"]["macs"], 4), "params_ratio": round(report["ratios"]["params"], 4),
            "held_count": len(held)}


def _check_outputs(out: Path, arch: str, shape: tuple[int, ...], reference_shape: list[int]) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    from optkit.io.models import load_model

    checks: dict = {}
    try:
        model = load_model(out / "model.pt", arch=arch).eval()
        example = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(example).float().numpy()
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: example.numpy()})[0]
        difference = float(np.abs(got - expected).max())
        scale = float(np.abs(expected).max())
        checks["onnx_max_abs_diff"] = difference
        checks["onnx_relative_diff"] = difference / scale if scale else difference
        checks["onnx_top1_same"] = bool((got.argmax(-1) == expected.argmax(-1)).all())
        checks["onnx_ok"] = (got.shape == expected.shape and scale > 0 and difference <= ONNX_RTOL * scale
                             and checks["onnx_top1_same"])
        checks["onnx_bytes"] = (out / "model.onnx").stat().st_size
    except Exception as e:  # the failure is the measurement
        checks.update(onnx_ok=False, check_error=f"onnx: {type(e).__name__}: {str(e)[:200]}")
    try:
        model = load_model(out / "model.pt", arch=arch).train()
        output = model(torch.randn(2, *shape[1:]))
        output.float().sum().backward()
        checks["output_shape"] = list(output.shape)
        checks["reload_ok"] = list(output.shape) == [2, *reference_shape]
    except Exception as e:  # the failure is the measurement
        checks.update(reload_ok=False, check_error=f"reload: {type(e).__name__}: {str(e)[:200]}")
    return checks


def markdown(data: dict) -> str:
    rows = data["models"]
    ok = [r for r in rows if r["status"] == "ok"]
    reached = [r for r in ok if r.get("macs_ratio", 1.0) <= 0.75]
    lines = [
        "# `optkit optimize` on the timm development set (state_dict + --arch wrapper, --prune 0.3 --export onnx)",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Machine: {data['machine']}; torch {data['torch']}, timm {data['timm']}, onnxruntime {data['onnxruntime']}. "
        f"Per model: a wrapper module (`class Model` building `timm.create_model(NAME, pretrained=False)`), its "
        f"`state_dict` saved with `torch.save` (all-zero weight matrices, such as the zero-initialized heads of timm's "
        f"MLP models, get N(0, {ZERO_INIT_STD:g}) values first so that no output is constant), then `optkit optimize model.pt --arch MODULE:Model --input-shape "
        f"1,C,H,W --prune {RATIO} --export onnx {' '.join(data['cli_args'])}` with a {data['time_limit_s']:g} s limit. "
        f"Checked here, apart from optkit: the saved model.pt reloads, runs forward and backward (train mode, batch 2) "
        f"with the original output shape, and model.onnx in ONNX Runtime matches the reloaded model within "
        f"{ONNX_RTOL:g} of the largest output magnitude with the same top-1 class.",
        "",
        f"**{len(ok)} of {len(rows)}** exit 0 and pass every check; {len(reached)} reach a MACs ratio of at most 0.75.",
        "",
        "| model | result | CLI s | MACs after/before | params after/before | held layers | ONNX rel. diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        result = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error') or r.get('check_error', '')}"
        diff = f"{r['onnx_relative_diff']:.1e}" if "onnx_relative_diff" in r else ""
        lines.append(f"| {r['model']} | {result} | {r.get('cli_seconds', '')} | {r.get('macs_ratio', '')} | "
                     f"{r.get('params_ratio', '')} | {r.get('held_count', '')} | {diff} |")
    lines += ["", "The held layers and the reason for each are in each run's report.json and in "
              "`benchmarks/results/zoo-timm.json` (same pruning, same settings)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="only these models; rows of the others are kept from the last run")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds each CLI run may take")
    parser.add_argument("--cli-arg", action="append", default=[], help="an extra argument for optkit optimize")
    args = parser.parse_args()

    import onnxruntime
    import timm
    import torch

    names = args.models or TIMM_MODELS
    unknown = sorted(set(names) - set(TIMM_MODELS))
    if unknown:
        parser.error(f"not in the development set: {', '.join(unknown)}")
    path = RESULTS / "timm-cli.json"
    previous = {r["model"]: r for r in json.loads(path.read_text())["models"]} if args.models and path.exists() else {}
    data = {
        "command": "python benchmarks/timm_cli.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "torch": torch.__version__, "timm": timm.__version__, "onnxruntime": onnxruntime.__version__,
        "time_limit_s": args.time_limit, "cli_args": args.cli_arg, "models": [],
    }
    for index, name in enumerate(TIMM_MODELS):
        if name not in names:
            if name in previous:
                data["models"].append(previous[name])
            continue
        with tempfile.TemporaryDirectory(prefix="optkit-timm-cli-") as work:
            row = run_one(name, Path(work), args.time_limit, args.cli_arg)
        data["models"].append(row)
        print(f"[{index + 1}/{len(TIMM_MODELS)}] {name}: {row['status']} {row.get('cli_seconds', '')} s "
              f"MACs {row.get('macs_ratio', '-')} {row.get('error') or row.get('check_error') or ''}", flush=True)
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        (RESULTS / "timm-cli.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
