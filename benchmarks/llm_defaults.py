"""Defaults by measurement for language models (#42): each pruning setting against optkit's default, one at a time.

The default is what ``optkit optimize MODEL --target-params F --calib-data text:FILE`` runs with no other flag
(``StructuredPrune(target_params=F, data=...)``: allocation and importance ``auto``, block inputs ``unpruned``,
refit on, 4 calibration batches of 16, 16 for a cut to 0.55 of the parameters or fewer). Every other row sets one
setting (a row that sets what the default resolves to repeats the default's figures). Nothing is trained after pruning;
perplexity is measured here (``llm.perplexity``, apart from optkit) on every block of the model's val and test
splits. A setting becomes a candidate default when it is the best of its factor on validation perplexity at every
fraction by more than :data:`MARGIN` and takes at most :data:`TIME_BUDGET` times the default's pruning time; the
test split only reports.

Run from the repository root::

    .venv/bin/python benchmarks/llm_defaults.py                                   # the shipped model
    .venv/bin/python benchmarks/llm_defaults.py --model DIR --data text:FILE --name NAME

Writes ``benchmarks/results/llm-defaults-NAME.{json,md}``.

The second model of the committed results (``--name stdlib``), made differently from the shipped one (other text:
the Python 3.11 standard library's sources; other shape: 6 heads sharing 3 key/value heads, hidden 192; other
seed), and how it was trained (``benchmarks/results/train-lm-stdlib.md``)::

    mkdir -p /tmp/stdlib-text && for f in /usr/lib/python3.11/*.py; do cp "$f" /tmp/stdlib-text/$(basename "$f" .py).txt; done
    .venv/bin/python benchmarks/train_lm.py --data text:/tmp/stdlib-text --out /tmp/lm-stdlib --seed 1 --minutes 12 \
        --sizes hidden_size=192,intermediate_size=640,num_hidden_layers=5,num_attention_heads=6,num_key_value_heads=3
    .venv/bin/python benchmarks/llm_defaults.py --model /tmp/lm-stdlib --data text:/tmp/stdlib-text --name stdlib
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import destination, partial_options  # noqa: E402
from llm import MODEL, RESULTS, ROOT, SEQ_LEN, params, perplexity, split_blocks  # noqa: E402

from optkit.core.files import write_text  # noqa: E402
from optkit.io.models import load_model  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402

#: One factor changed at a time: (factor, setting's label, the StructuredPrune keywords it changes).
VARIANTS = (
    ("allocation", "uniform", {"allocation": "uniform"}),
    ("importance", "l1", {"importance": "l1"}),
    ("importance", "activation", {"importance": "activation"}),
    ("block inputs", "pruned", {"block_inputs": "pruned"}),
    ("calibration batches", "4", {"calibration_batches": 4}),
    ("calibration batches", "16", {"calibration_batches": 16}),
    ("refit", "off", {"bias_correction": False}),
)
#: A setting may take at most this many times the default's pruning time to become the default.
TIME_BUDGET = 3.0
#: A setting must lower validation perplexity by more than this fraction to displace the default (smaller moves
#: are within what a different calibration draw gives).
MARGIN = 0.005
#: Rows are compared with the default when they keep at most this much more of the parameters than it does (a
#: setting that lands on a larger MLP width within the target's tolerance is not better for that alone).
PARAMS_SLACK = 0.005


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL), help="a Hugging Face folder (default: the shipped model)")
    parser.add_argument("--data", default="text", help="the text data spec (default %(default)s, the shipped text)")
    parser.add_argument("--name", default="shipped", help="the results' name: llm-defaults-NAME.{json,md}")
    parser.add_argument("--fractions", type=lambda v: [float(x) for x in v.split(",")], default=[0.8, 0.5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    out = destination(args.out, partial_options(parser, args, ["fractions"]))
    torch.set_num_threads(args.threads)

    original = load_model(args.model).eval()
    splits = {split: split_blocks(original, split, data=args.data) for split in ("val", "test")}
    base = {split: perplexity(original, b)[0] for split, b in splits.items()}
    rows = []
    for fraction in args.fractions:
        for factor, label, change in (("default", "default", {}), *VARIANTS):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            pruned = StructuredPrune(target_params=fraction, input_shape=(1, SEQ_LEN), data=args.data,
                                     **change).apply(copy.deepcopy(original)).model.eval()
            row = {"fraction": fraction, "factor": factor, "setting": label, "change": change,
                   "prune_s": round(time.perf_counter() - start, 1), "load_avg_1min_before": round(load, 2),
                   "params_fraction": round(params(pruned) / params(original), 4),
                   "shape": [pruned.config.num_attention_heads, pruned.config.num_key_value_heads,
                             pruned.config.intermediate_size]}
            for split, b in splits.items():
                row[f"{split}_ppl"] = round(perplexity(pruned, b)[0], 3)
                row[f"{split}_ratio"] = round(row[f"{split}_ppl"] / base[split], 4)
            rows.append(row)
            print(row, flush=True)
    record = {"command": "python benchmarks/llm_defaults.py " + " ".join(sys.argv[1:]),
              "model": _shown(args.model), "name": args.name, "data": args.data, "seq_len": SEQ_LEN,
              "threads": args.threads, "base": base, "blocks": {s: sum(len(x["input_ids"]) for x in b)
                                                                for s, b in splits.items()},
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
              "time_budget": TIME_BUDGET, "rows": rows, "verdict": verdict(rows, args.fractions)}
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"llm-defaults-{args.name}.json", json.dumps(record, indent=2) + "\n")
    write_text(out / f"llm-defaults-{args.name}.md", markdown(record))


def _shown(model: str) -> str:
    """The model's folder relative to the repository when it is inside it, else as given."""
    path = Path(model).resolve()
    return os.path.relpath(path, ROOT) if ROOT in path.parents else model


def verdict(rows: list[dict], fractions: list[float]) -> dict:
    """Per fraction: the default's validation ratio, the best row's, and whether the default is within 1 % of it;
    the settings that beat the default on validation at every fraction within the time budget."""
    out: dict = {"per_fraction": {}, "better_everywhere": []}
    for fraction in fractions:
        here = [r for r in rows if r["fraction"] == fraction]
        default = next(r for r in here if r["factor"] == "default")
        comparable = [r for r in here if r["params_fraction"] <= default["params_fraction"] + PARAMS_SLACK]
        best = min(comparable, key=lambda r: r["val_ppl"])
        larger = [r for r in here if r not in comparable and r["val_ppl"] < best["val_ppl"]]
        out["per_fraction"][str(fraction)] = {
            "default_val_ratio": default["val_ratio"], "default_test_ratio": default["test_ratio"],
            "default_params": default["params_fraction"],
            "best": best["setting"] if best is not default else "default", "best_val_ratio": best["val_ratio"],
            "default_within_1pct": default["val_ppl"] <= best["val_ppl"] * 1.01,
            "better_with_more_params": [{"setting": r["setting"], "params_fraction": r["params_fraction"],
                                         "val_ratio": r["val_ratio"]} for r in larger]}
    for factor, label, _ in VARIANTS:
        mine = [r for r in rows if r["setting"] == label and r["factor"] == factor]
        defaults = {r["fraction"]: r for r in rows if r["factor"] == "default"}
        if mine and all(r["val_ppl"] < defaults[r["fraction"]]["val_ppl"] * (1 - MARGIN)
                        and r["params_fraction"] <= defaults[r["fraction"]]["params_fraction"] + PARAMS_SLACK
                        and r["prune_s"] <= TIME_BUDGET * max(defaults[r["fraction"]]["prune_s"], 1.0)
                        for r in mine):
            out["better_everywhere"].append(f"{factor} {label}")
    return out


def markdown(record: dict) -> str:
    trained = f"train-lm-{record['name']}.md"
    how = f" (trained as `benchmarks/results/{trained}` records)" if (RESULTS / trained).exists() else ""
    lines = [f"# Defaults by measurement, language model `{record['model']}`{how}", "",
             f"Command: `{record['command'].strip()}` ({record['threads']} threads; {record['machine']}). "
             "Each row prunes to the parameter fraction with nothing trained afterwards; each non-default row "
             "changes one setting from what `optkit optimize MODEL --target-params F --calib-data "
             f"{record['data']}` runs. Perplexity measured by this script on every block of val "
             f"({record['blocks']['val']}) and test ({record['blocks']['test']}); unpruned: val "
             f"{record['base']['val']:.2f}, test {record['base']['test']:.2f}. Seconds are pruning time (wall; the "
             "1-minute load average before each row is in the last column: above 2 the seconds are stretched).", "",
             "| params (target) | factor | setting | params kept | heads / KV / MLP | val ppl (×) | test ppl (×) | "
             "s | load |", "|---:|---|---|---:|---|---:|---:|---:|---:|"]
    for r in record["rows"]:
        shape = " / ".join(map(str, r["shape"]))
        lines.append(f"| {r['fraction']:g} | {r['factor']} | {r['setting']} | {r['params_fraction']:.3f} | {shape} | "
                     f"{r['val_ppl']:.2f} ({r['val_ratio']:.3f}×) | {r['test_ppl']:.2f} ({r['test_ratio']:.3f}×) | "
                     f"{r['prune_s']:.0f} | {r['load_avg_1min_before']:.1f} |")
    lines += ["", "## Verdict", ""]
    for fraction, v in record["verdict"]["per_fraction"].items():
        larger = "".join(f" ({r['setting']} keeps {r['params_fraction']:.3f} of the parameters, more than the "
                         f"default's {v['default_params']:.3f}: val {r['val_ratio']:.3f}×)"
                         for r in v.get("better_with_more_params", []))
        lines.append(f"- {fraction}: default val {v['default_val_ratio']:.3f}× (test {v['default_test_ratio']:.3f}×);"
                     f" best of the rows keeping at most {PARAMS_SLACK:g} more of the parameters: {v['best']} val "
                     f"{v['best_val_ratio']:.3f}×; default within 1 % of it: "
                     f"**{'yes' if v['default_within_1pct'] else 'no'}**{larger}")
    better = record["verdict"]["better_everywhere"]
    lines.append(f"- Settings better than the default on validation by more than {MARGIN:.1%} at every fraction, "
                 f"within {record['time_budget']:g}× its time: {', '.join(better) if better else 'none'}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
