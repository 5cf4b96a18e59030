"""``target_macs=0.5`` with default settings: how close the ratio search lands, on small and large models.

Models: the trained Fashion-MNIST baseline that ships with optkit (28×28, channels 32-128, where
round_to 16 moves MACs in coarse steps) and torchvision resnet18, mobilenet_v2, resnet50, vit_b_16
at 224×224 (random weights: the channel counts, not the values, decide the MACs).

Usage:

    python benchmarks/prune_targets.py [MODEL ...]

Writes benchmarks/results/prune_targets.json and prune_targets.md; a run of some of the models writes them
to a temporary folder instead (see ``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _results import destination

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("fashion_resnet", "resnet18", "mobilenet_v2", "resnet50", "vit_b_16")
TARGET = 0.5
TOLERANCE = 0.02
SHAPE = (1, 3, 224, 224)
FASHION_SHAPE = (1, 1, 28, 28)


def _model(name: str):
    from optkit.demo import FASHION_RESNET
    from optkit.io.models import load_model

    if name == "fashion_resnet":
        return load_model(FASHION_RESNET), FASHION_SHAPE
    return load_model(f"torchvision:{name}"), SHAPE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"torchvision names, or fashion_resnet (default: {', '.join(MODELS)})")
    args = parser.parse_args(argv)
    names = args.models or list(MODELS)
    partial = [f"models {','.join(names)}"] if set(names) != set(MODELS) else []
    import torch

    from optkit.core.files import write_text
    from optkit.model.stats import count_macs
    from optkit.passes.prune.passes import DEFAULT_ROUND_TO, StructuredPrune

    rows = []
    for name in names:
        model, shape = _model(name)
        start = time.perf_counter()
        result = StructuredPrune(target_macs=TARGET, input_shape=shape).apply(model)
        seconds = time.perf_counter() - start
        achieved = count_macs(result.model, shape) / count_macs(model, shape)
        rows.append({"model": name, "input_shape": list(shape), "target_macs": TARGET,
                     "achieved_macs_fraction": round(achieved, 4), "within_tolerance": abs(achieved - TARGET) <= TOLERANCE,
                     "ratio": result.details["ratio"], "round_to": result.details["round_to"],
                     "tries": result.details["tries"], "notes": result.details.get("notes", []),
                     "seconds": round(seconds, 1)})
        print(rows[-1], flush=True)
    command = "python " + " ".join(["benchmarks/prune_targets.py", *sys.argv[1:]])
    machine = {"torch_threads": torch.get_num_threads(), "load_average": [round(v, 2) for v in os.getloadavg()]}
    lines = ["# Structured pruning to a MACs target", "", f"Command: `{command}`", "",
             f"`StructuredPrune(target_macs={TARGET})` with default settings (L1 importance, round_to "
             f"{DEFAULT_ROUND_TO}, tolerance 0.01). Each try prunes a fresh copy; when round_to steps over the "
             "target with one ratio, groups are cut by different multiples of round_to, as evenly as the steps allow "
             "(ratio column: per group), and only if that misses too is round_to halved (the report says so). "
             "Random-init weights "
             f"except the Fashion-MNIST baseline. {machine['torch_threads']} torch thread(s), load average at the end "
             f"{machine['load_average']} (the seconds are this run's, not a timing benchmark).", "",
             f"| model | input | achieved MACs fraction | within ±{TOLERANCE} | ratio | round_to used | tries | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {'×'.join(map(str, r['input_shape'][1:]))} | {r['achieved_macs_fraction']:.4f} | "
              f"{'yes' if r['within_tolerance'] else 'no'} | {'per group' if r['ratio'] is None else r['ratio']} | {r['round_to']} | {len(r['tries'])} | "
              f"{r['seconds']} |" for r in rows]
    json_path, md_path = (destination(RESULTS / name, partial) for name in ("prune_targets.json", "prune_targets.md"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(json_path, json.dumps({"command": command, "machine": machine, "models": rows}, indent=1) + "\n")
    write_text(md_path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
