"""Two runs of ``benchmarks/speedup.py`` side by side: the MACs ratios must match exactly, the speed-ups within noise.

torch-pruning's rows are the control: its code did not change between the runs, so how far its speed-ups move
is how far this machine's timing moves on its own.

Usage:

    git show COMMIT:benchmarks/results/speedup.json > /tmp/speedup-before.json
    python benchmarks/compare_speedup.py /tmp/speedup-before.json benchmarks/results/speedup.json \\
        --label-before COMMIT --out benchmarks/results/speedup-regression.md

Results without timings (each variant only its ``macs_ratio``) compare their MACs ratios alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SETTINGS = ("t2_b1", "t2_b8", "t1_b1", "t1_b8")
VARIANTS = ("optkit", "torch_pruning")


def compare(before: dict, after: dict) -> dict:
    """Per model and variant: both MACs ratios, and per setting both speed-ups and their relative change."""
    old = {m["model"]: m for m in before["models"]}
    rows = []
    for new in after["models"]:
        if new["model"] not in old:
            continue
        for variant in VARIANTS:
            a, b = old[new["model"]][variant], new[variant]
            rows.append({"model": new["model"], "variant": variant, "macs": (a["macs_ratio"], b["macs_ratio"]),
                         "speedup": {s: (a[s]["speedup"], b[s]["speedup"], b[s]["speedup"] / a[s]["speedup"] - 1)
                                     for s in SETTINGS if s in a and s in b}})
    return {"rows": rows, "macs_identical": all(r["macs"][0] == r["macs"][1] for r in rows)}


def markdown(result: dict, label_before: str, label_after: str, dates: tuple[str, str]) -> str:
    lines = [f"# Speed-up regression: {label_before} against {label_after}", "",
             f"Runs of `benchmarks/speedup.py` from {dates[0]} ({label_before}) and {dates[1]} ({label_after}), "
             "on the same kind of machine. Written by `python benchmarks/compare_speedup.py` (its docstring has "
             "the command).", "",
             f"**MACs ratios: {'identical' if result['macs_identical'] else 'NOT identical'}** for every model "
             "and variant.", "",
             "Speed-up over the unpruned model, before -> after (relative change), per intra-op thread count "
             "tN and batch bM:", "",
             "| model | variant | MACs ratio | " + " | ".join(SETTINGS) + " |",
             "|---|---|---:|" + "---|" * len(SETTINGS)]
    for row in result["rows"]:
        cells = [f"{a:.2f} -> {b:.2f} ({change:+.0%})" for a, b, change in row["speedup"].values()]
        cells += ["-"] * (len(SETTINGS) - len(cells))
        macs = row["macs"][1] if row["macs"][0] == row["macs"][1] else f"**{row['macs'][0]} -> {row['macs'][1]}**"
        lines.append(f"| {row['model']} | {row['variant']} | {macs} | " + " | ".join(cells) + " |")
    lines += ["", "Largest relative change per variant and thread count (absolute):", ""]
    for variant in VARIANTS:
        for threads in ("t1", "t2"):
            changes = [abs(c) for r in result["rows"] if r["variant"] == variant
                       for s, (_, _, c) in r["speedup"].items() if s.startswith(threads)]
            if changes:
                lines.append(f"- {variant}, {threads}: max {max(changes):.0%}, "
                             f"median {statistics.median(changes):.0%}")
    if result["macs_identical"]:
        lines += ["", "With the same MACs ratios the pruned models have the same layer widths, so their ONNX files "
                      "do the same work; what moves between the runs is this machine's timing (torch-pruning's "
                      "rows, whose code did not change, move too). One thread is the steadier measure here."]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--label-before", default="before")
    parser.add_argument("--label-after", default="after")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before, after = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    result = compare(before, after)
    args.out.write_text(markdown(result, args.label_before, args.label_after, (before["date"], after["date"])))
    print(f"MACs identical: {result['macs_identical']}; wrote {args.out}")


if __name__ == "__main__":
    main()
