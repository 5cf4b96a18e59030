"""``target_macs=0.5`` on resnet50, mobilenet_v2 and vit_b_16: how close the ratio search lands.

Usage:

    python benchmarks/prune_targets.py

Writes benchmarks/results/prune_targets.json and prune_targets.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("resnet50", "mobilenet_v2", "vit_b_16")
TARGET = 0.5
SHAPE = (1, 3, 224, 224)


def main() -> None:
    from optkit.io.files import write_text
    from optkit.analysis.metrics import count_macs
    from optkit.io.models import load_model
    from optkit.passes.prune.passes import StructuredPrune

    rows = []
    for name in sys.argv[1:] or MODELS:
        model = load_model(f"torchvision:{name}")
        start = time.perf_counter()
        result = StructuredPrune(target_macs=TARGET, input_shape=SHAPE).apply(model)
        seconds = time.perf_counter() - start
        achieved = count_macs(result.model, SHAPE) / count_macs(model, SHAPE)
        rows.append({"model": name, "target_macs": TARGET, "achieved_macs_fraction": round(achieved, 4),
                     "within_0.03": abs(achieved - TARGET) <= 0.03, "ratio": result.details["ratio"],
                     "tries": result.details["tries"], "seconds": round(seconds, 1)})
        print(rows[-1], flush=True)
    command = "python " + " ".join(["benchmarks/prune_targets.py", *sys.argv[1:]])
    lines = ["# Structured pruning to a MACs target", "", f"Command: `{command}`", "",
             f"`StructuredPrune(target_macs={TARGET})` at input {SHAPE}, random-init weights, defaults otherwise "
             "(L1, round_to 8). Each try prunes a fresh copy; the search stops within 0.01 of the target or after 12 tries.",
             "", "| model | achieved MACs fraction | within ±0.03 | ratio | tries | seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['achieved_macs_fraction']:.4f} | {'yes' if r['within_0.03'] else 'no'} | "
              f"{r['ratio']} | {len(r['tries'])} | {r['seconds']} |" for r in rows]
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_text(RESULTS / "prune_targets.json", json.dumps({"command": command, "models": rows}, indent=1) + "\n")
    write_text(RESULTS / "prune_targets.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
