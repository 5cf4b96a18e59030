"""#44's "no behaviour change", measured: two commits, each checked out in a git worktree, compared on

1. ``make demo``'s command (every figure its report gives: parameters, MACs, weights, each stage's evaluation),
   run with :mod:`demo_regression`'s runner;
2. the MACs ratio of ``StructuredPrune(ratio=0.3)`` on every model of ``benchmarks/speedup.py`` (the "optkit" rows
   of ``speedup.md``), computed by each checkout's own optkit in a fresh process;
3. the MACs ratio of every type of ``benchmarks/hf_zoo.py`` (``hf-zoo.md``), from each checkout's own script.

Every process runs with this checkout's virtual environment and ``PYTHONPATH`` at the worktree, so only optkit's
source differs. Writes ``benchmarks/results/house-regression.{json,md}``.

Usage::

    python benchmarks/house_regression.py                          # 6073004 (before the house) against HEAD
    python benchmarks/house_regression.py --before 6073004 --after 7e7fcd2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import demo_regression
import speedup

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
BEFORE = "6073004"
NAME = "house-regression"

# Runs inside a worktree; count_macs moved from analysis.metrics to model.stats with the house.
MACS_PROBE = textwrap.dedent("""
    import json, sys, torch, torchvision
    try:
        from optkit.model.stats import count_macs
    except ImportError:
        from optkit.analysis.metrics import count_macs
    from optkit.passes.prune.passes import StructuredPrune
    shape, ratio, out = tuple(json.loads(sys.argv[1])), float(sys.argv[2]), {}
    for name in sys.argv[3:]:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name).eval()
        base = count_macs(model, shape)
        StructuredPrune(ratio=ratio, input_shape=shape)(model)
        out[name] = round(count_macs(model, shape) / base, 4)
        print(name, out[name], file=sys.stderr, flush=True)
    print(json.dumps(out))
""")


def _env(source: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{source}:{source / 'benchmarks'}", "COLUMNS": "120"}


def speedup_macs(source: Path, models: list[str]) -> dict[str, float]:
    """``StructuredPrune(ratio=speedup.RATIO)``'s MACs ratio per model, from the optkit at ``source``."""
    done = subprocess.run([sys.executable, "-c", MACS_PROBE, json.dumps(speedup.INPUT_SHAPE), str(speedup.RATIO),
                           *models], cwd=source, env=_env(source), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the MACs probe failed in {source}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_zoo_macs(source: Path, out: Path) -> dict[str, float | None]:
    """Each hf_zoo row's MACs ratio, from the script and optkit at ``source``."""
    done = subprocess.run([sys.executable, str(source / "benchmarks" / "hf_zoo.py"), "--out", str(out)], cwd=source,
                          env=_env(source), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hf_zoo.py failed in {source}: {done.stderr.strip()[-800:]}")
    rows = json.loads((out / "hf-zoo.json").read_text())["rows"]
    return {row["type"] + (f" --drop-blocks {row['drop_blocks']}" if row.get("drop_blocks") else ""):
            row.get("macs_ratio") for row in rows}


def revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help="the earlier commit (default %(default)s)")
    parser.add_argument("--after", default="HEAD", help="the later commit (default %(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    commits = {"before": revision(args.before), "after": revision(args.after)}
    found: dict[str, dict] = {label: {} for label in commits}
    with tempfile.TemporaryDirectory(prefix="optkit-house-regression-") as tmp:
        sources = {label: Path(tmp) / label for label in commits}
        try:
            for label, rev in commits.items():
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(sources[label]), rev], cwd=REPO,
                               check=True)
            for label, source in sources.items():
                print(f"{label} ({commits[label]}): make demo's command", flush=True)
                found[label]["demo"] = demo_regression.run(source, Path(tmp) / f"demo-{label}", demo_regression.DEMO)
                print(f"{label}: speedup.py's models", flush=True)
                found[label]["speedup_macs"] = speedup_macs(source, list(speedup.MODELS))
                print(f"{label}: hf_zoo.py", flush=True)
                found[label]["hf_zoo_macs"] = hf_zoo_macs(source, Path(tmp) / f"hf-zoo-{label}")
        finally:
            for source in sources.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(source)], cwd=REPO, check=False)

    result = {
        "commits": commits, "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "demo_command": f"optkit {demo_regression.DEMO}",
        "demo_identical": found["before"]["demo"]["compared"] == found["after"]["demo"]["compared"],
        "speedup_macs_identical": found["before"]["speedup_macs"] == found["after"]["speedup_macs"],
        "hf_zoo_macs_identical": found["before"]["hf_zoo_macs"] == found["after"]["hf_zoo_macs"],
        "runs": found,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results / f"{NAME}.md").write_text(markdown(result))
    print(f"wrote {args.results / NAME}.{{json,md}}")


def _verdict(same: bool) -> str:
    return "identical" if same else "NOT identical"


def markdown(result: dict) -> str:
    """The comparison as a page: each check's verdict, then both sides' figures."""
    before, after = result["commits"]["before"], result["commits"]["after"]
    runs = result["runs"]
    lines = [f"# The house (#44): {before} against {after}", "",
             f"Measured {result['date']} on {result['machine']['cpu']} ({result['machine']['cpus']} CPUs) with "
             "`python benchmarks/house_regression.py` (each commit in a git worktree, this checkout's virtual "
             "environment, PYTHONPATH at the worktree).", "",
             f"- `make demo`'s command (`{result['demo_command']}`): every figure of the report "
             f"**{_verdict(result['demo_identical'])}**.",
             f"- `StructuredPrune(ratio={speedup.RATIO})` MACs ratio on `speedup.py`'s models: "
             f"**{_verdict(result['speedup_macs_identical'])}**.",
             f"- `hf_zoo.py`'s MACs ratios: **{_verdict(result['hf_zoo_macs_identical'])}**.", "",
             "## make demo", "", f"| stage | top-1 {before} | top-1 {after} | mean KL {before} | mean KL {after} |",
             "|---|---:|---:|---:|---:|"]
    for old, new in zip(runs["before"]["demo"]["compared"]["stages"], runs["after"]["demo"]["compared"]["stages"]):
        def cell(row: dict, key: str, fmt: str) -> str:
            return "-" if row.get(key) is None else format(row[key], fmt)
        lines.append(f"| {new['stage']} | {cell(old, 'accuracy', '.2%')} | {cell(new, 'accuracy', '.2%')} | "
                     f"{cell(old, 'mean_kl', '.5f')} | {cell(new, 'mean_kl', '.5f')} |")
    for title, key in (("speedup.py models", "speedup_macs"), ("hf_zoo.py types", "hf_zoo_macs")):
        lines += ["", f"## MACs ratios: {title}", "", f"| model | {before} | {after} |", "|---|---:|---:|"]
        old, new = runs["before"][key], runs["after"][key]
        for name in sorted(set(old) | set(new)):
            a, b = old.get(name, "absent"), new.get(name, "absent")
            lines.append(f"| {name} | {a} | {b if a == b else f'**{b}**'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
