"""``make demo``'s command at an earlier commit and at this checkout, side by side (issue #28: nothing regresses).

The earlier commit is checked out into a temporary git worktree and run with this checkout's virtual
environment (``PYTHONPATH`` set to the worktree, so its own ``optkit`` is imported). Runs alternate
(before, now, before, now) so that latency is compared under the same conditions. The figures that must not
move are compared exactly: parameters, MACs, every stage's evaluation, the file's gzipped size; latency is
reported, not compared. A default that changed on purpose since the earlier commit is given on the command
line of both (``--lr``: 1e-3 before #31 made 3e-3 the default), so what is compared is the refactor alone.

Usage:

    python benchmarks/demo_regression.py                      # c5ec854, the commit before the model kinds
    python benchmarks/demo_regression.py --before COMMIT --repeats 2
    python benchmarks/demo_regression.py --before A --after B --lr none --keep /tmp/demo-runs --results /tmp/out
        # two commits (each in a worktree), make demo's own command (no --lr), every run's folder and console kept

Writes benchmarks/results/demo-regression.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
BEFORE = "c5ec854"
LR = "0.001"
DEMO = ("optimize optkit/demo/fashion_resnet.pt --target-macs 0.5 --recalibrate-bn 20 --calib-data fashion-mnist "
        "--finetune fashion-mnist --epochs 1 --train-amp bf16 --eval fashion-mnist --export onnx --latency --force")


def run(source: Path, out: Path, command: str) -> dict:
    """One demo run from the checkout at ``source``; its report's figures and the wall time."""
    env = {**os.environ, "PYTHONPATH": str(source), "COLUMNS": "120"}
    load = os.getloadavg()[0]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "optkit", *shlex.split(command), "--out", str(out)], cwd=source,
                          env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    (out.parent / f"{out.name}.console.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the demo failed in {source} (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    report = json.loads((out / "report.json").read_text())
    latency = report.get("onnx_latency") or {}
    at_batch = latency.get("at_batch") or {}
    return {
        "seconds": round(seconds, 1),
        "load_average_1min_before": round(load, 2),
        "compared": {
            "before": report["before"], "after": report["after"], "ratios": report["ratios"],
            "accuracy": report["accuracy"],
            "stages": [{k: row.get(k) for k in ("stage", "accuracy", "agreement", "mean_kl")}
                       for row in report["evaluation"]["stages"]],
            "weights": next((n for n in report["notes"] if n.startswith("weights:")), None),
        },
        "onnx_ms": {f"batch {batch}": [round(entry[side]["median_ms"], 3) for side in ("before", "after")]
                    for batch, entry in ((latency.get("batch_size"), latency), (at_batch.get("batch_size"), at_batch))
                    if batch and "before" in entry},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help="the earlier commit (default %(default)s)")
    parser.add_argument("--after", help="the later commit, checked out in a worktree too (default: this checkout)")
    parser.add_argument("--lr", default=LR, help="--lr given to both runs (default %(default)s, the rate before #31); "
                        "'none' runs make demo's command as it is")
    parser.add_argument("--keep", type=Path, help="copy every run's output folder and console output here")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating (default %(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", args.after or "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    command = DEMO if args.lr == "none" else f"{DEMO} --lr {args.lr}"
    runs: dict[str, list[dict]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="optkit-demo-regression-") as tmp:
        sources = {"before": Path(tmp) / "before", "now": Path(tmp) / "now" if args.after else REPO}
        worktrees = [(sources["before"], args.before)] + ([(sources["now"], args.after)] if args.after else [])
        try:
            for worktree, rev in worktrees:
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), rev], cwd=REPO, check=True)
            for i in range(args.repeats):
                for label, source in sources.items():
                    runs[label].append(run(source, Path(tmp) / f"{label}-{i}", command))
                    print(f"{label} run {i + 1}: {runs[label][-1]['seconds']} s", flush=True)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for i in range(args.repeats):
                    for label in sources:
                        shutil.copytree(Path(tmp) / f"{label}-{i}", args.keep / f"{label}-{i}", dirs_exist_ok=True)
                        shutil.copy(Path(tmp) / f"{label}-{i}.console.txt", args.keep)
        finally:
            for worktree, _ in worktrees:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)

    same = all(r["compared"] == runs["before"][0]["compared"] for r in runs["before"] + runs["now"])
    result = {"before": args.before, "now": commit, "command": f"optkit {command}", "identical": same, "runs": runs,
              "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "demo-regression.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results / "demo-regression.md").write_text(markdown(result))
    print(f"identical: {same}")


def markdown(result: dict) -> str:
    first = result["runs"]["now"][0]["compared"]
    lines = [
        f"# `make demo` at {result['before']} and at {result['now']}",
        "",
        "Command, run from each checkout with this checkout's virtual environment (`python "
        "benchmarks/demo_regression.py`):",
        "",
        f"    {result['command']}",
        "",
        *(["`--lr 0.001` is the earlier default; #31 changed the default to 3e-3 on purpose "
           "(benchmarks/results/defaults.md), so both runs are given the same rate and only the refactor differs.",
           ""] if "--lr 0.001" in result["command"] else []),
        f"**Every compared figure is {'identical' if result['identical'] else 'NOT identical'}** across "
        f"{sum(len(v) for v in result['runs'].values())} alternating runs: parameters {first['before']['params']:,} "
        f"-> {first['after']['params']:,}, MACs {first['before']['macs']:,} -> {first['after']['macs']:,}, "
        f"{first['weights']}, and every stage's evaluation:",
        "",
        "| stage | top-1 | agreement | mean KL |",
        "|---|---:|---:|---:|",
    ]
    for row in first["stages"]:
        def cell(key: str, fmt: str) -> str:
            return "-" if row[key] is None else format(row[key], fmt)
        lines.append(f"| {row['stage']} | {cell('accuracy', '.2%')} | {cell('agreement', '.2%')} | "
                     f"{cell('mean_kl', '.4f')} |")
    batches = list(result["runs"]["now"][0]["onnx_ms"])
    lines += ["", "ONNX Runtime latency from each run's report, ms median, original -> pruned (reported, not "
                  "compared: one 2-vCPU VM, the runs alternating, each run's load average beside it):", "",
              "| run | load (1 min) | wall s | " + " | ".join(batches) + " |",
              "|---|---:|---:|" + "---|" * len(batches)]
    for label in ("before", "now"):
        for i, run_ in enumerate(result["runs"][label]):
            cells = [" -> ".join(str(v) for v in run_["onnx_ms"].get(b, [])) for b in batches]
            lines.append(f"| {label} {i + 1} | {run_['load_average_1min_before']} | {run_['seconds']} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Machine: {result['machine']['cpu']}, {result['machine']['cpus']} CPUs.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
