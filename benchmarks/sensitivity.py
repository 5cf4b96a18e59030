"""``optkit sensitivity`` on resnet18 at 64×64 with 512 Fashion-MNIST images: cost, cached rerun, recipe replay.

Runs the command as a user would (a subprocess, a fresh cache): once cold, once again (every point
from the cache), then ``optkit optimize ... --recipe`` with the recipe it wrote, and checks that the
replayed MACs fraction equals the one the analysis reported. The weights are random but fixed (a
saved state_dict), so the second run can reuse the first one's measurements.

Run (timings only mean something when nothing else heavy runs)::

    flock /tmp/optkit-bench.lock python benchmarks/sensitivity.py

Writes ``benchmarks/results/sensitivity-resnet18.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = ["--arch", "torchvision:resnet18", "--num-classes", "10", "--input-shape", "1,3,64,64"]
ANALYSIS = ["--data", "fashion-mnist", "--samples", "512", "--target-macs", "0.5"]
LIMIT_S = 300


def _run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "optkit", *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"optkit {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return seconds, done.stdout


def main(argv: list[str] | None = None) -> None:
    # No options: the parser gives --help (which would otherwise run the whole benchmark) and refuses others.
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="optkit-sensitivity-bench-") as folder:
        work = Path(folder)
        env = {**os.environ, "OPTKIT_CACHE_DIR": str(work / "cache")}
        torch.manual_seed(0)
        weights = work / "resnet18.pt"
        torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), weights)
        out = work / "sens"
        cold, _ = _run(["sensitivity", str(weights), *MODEL, *ANALYSIS, "--out", str(out)], env)
        summary = json.loads((out / "sensitivity.json").read_text())
        table = (out / "sensitivity.md").read_text()
        cached, _ = _run(["sensitivity", str(weights), *MODEL, *ANALYSIS, "--out", str(out), "--force"], env)
        rerun = json.loads((out / "sensitivity.json").read_text())
        _run(["optimize", str(weights), *MODEL, "--recipe", str(out / "recipe.toml"), "--out", str(work / "run")], env)
        report = json.loads((work / "run" / "report.json").read_text())
        replayed = report["after"]["macs"] / report["before"]["macs"]
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "sensitivity.png", RESULTS / "sensitivity-resnet18.png")
    allocation = summary["allocation"]
    result = {"command": "python benchmarks/sensitivity.py", "model": "torchvision:resnet18 (random weights, 10 classes)",
              "input_shape": [1, 3, 64, 64], "samples": 512, "cold_seconds": round(cold, 1),
              "cached_seconds": round(cached, 1), "limit_seconds": LIMIT_S, "points": summary["cost"],
              "rerun_points": rerun["cost"],
              "allocation": allocation, "replayed_macs_fraction": round(replayed, 6),
              "replay_matches": abs(replayed - allocation["achieved_fraction"]) < 1e-4,
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "load_average": os.getloadavg()}}
    (RESULTS / "sensitivity-resnet18.json").write_text(json.dumps({**result, "curves": summary["curves"]}, indent=1) + "\n")
    lines = ["# `optkit sensitivity` on resnet18 at 64×64", "", f"Command: `{result['command']}`", "",
             f"`optkit sensitivity resnet18.pt {' '.join(MODEL + ANALYSIS)}` as a subprocess with an empty cache: "
             f"**{cold:.0f} s** (limit {LIMIT_S} s; {summary['cost']['measured']} points measured); "
             f"rerun {cached:.0f} s ({rerun['cost']['cached']} points from the cache, {rerun['cost']['measured']} "
             "measured; the rest is start-up, data loading and the allocation's check prunes). "
             f"Allocation for MACs 0.5: achieved {allocation['achieved_fraction']:.4f}; "
             f"`optkit optimize --recipe recipe.toml` replays it at {replayed:.4f} "
             f"({'equal' if result['replay_matches'] else 'DIFFERENT'}). Load average at the end "
             f"{', '.join(f'{v:.2f}' for v in result['machine']['load_average'])}; "
             f"{result['machine']['cpus']} CPUs.", "", "The command's own table:", "", table]
    (RESULTS / "sensitivity-resnet18.md").write_text("\n".join(lines))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
