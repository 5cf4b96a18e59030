"""Compare ``benchmarks/llm.py`` runs of two code versions: test perplexity per target and method, side by side.

Reads the ``llm.json`` files given (``LABEL=PATH``) and writes one Markdown table of every (target, method)
row: parameters kept, heads / KV heads / MLP width and test perplexity (× the unpruned model) per label.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH of an llm.json; rows of several files may share a label")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    parser.add_argument("--title", default="benchmarks/llm.py before and after")
    args = parser.parse_args()
    rows: dict[tuple[float, str], dict[str, dict]] = {}
    labels: list[str] = []
    commands = []
    for run in args.runs:
        label, _, path = run.partition("=")
        record = json.loads(Path(path).read_text())
        commands.append(f"- {label}: `{record['command']}` ({Path(path).name})")
        labels += [label] if label not in labels else []
        for row in record["rows"]:
            rows.setdefault((row["target"], row["method"]), {})[label] = row
    unpruned = next(r for (t, m), by in rows.items() if m == "unpruned" for r in by.values())["test_perplexity"]
    lines = [f"# {args.title}", "", *commands, "",
             "| target | method | " + " | ".join(f"{l}: kept, heads/KV/MLP, test ppl (×)" for l in labels) + " |",
             "|---:|---|" + "---|" * len(labels)]
    for (target, method), by in sorted(rows.items(), key=lambda item: (-item[0][0], item[0][1])):
        cells = []
        for label in labels:
            row = by.get(label)
            cells.append("–" if row is None else
                         f"{row['params_fraction']:.3f}, {row['heads']}/{row['kv_heads']}/{row['intermediate']}, "
                         f"{row['test_perplexity']:.2f} ({row['test_perplexity'] / unpruned:.3f}×)")
        lines.append(f"| {target:g} | {method} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
