"""Perplexity of the shipped language model after structured pruning to a parameter target, without training (#30).

The model is ``optkit/demo/python_docs_lm`` (a Llama-style causal LM trained by
``benchmarks/train_lm.py`` on the train split of the ``text`` spec). For each
fraction of parameters kept it is pruned, with nothing trained afterwards:

* ``magnitude``: ``structured_prune`` with ``target_params`` alone: the same share
  of heads (whole heads) and MLP channels from every block, ranked by weight norm;
* ``uniform + refit``: the same with ``data="text"``: the layers that lost inputs
  are refitted by least squares on calibration text (``bias_correction``);
* ``mix + refit``: ``allocation="sensitivity"``: the cut split between heads and
  MLP channels by validation perplexity, then refitted (heads and channels
  ranked by weight norm, ``importance="l1"``);
* ``default``: what ``--target-params F --calib-data text`` runs: the mix, with
  heads and channels ranked by weight x input activation norm
  (``importance="auto"`` resolves to ``activation``);
* ``torch-pruning``: torch-pruning's LLM example recipe (magnitude, heads and
  hidden channels at one ratio) called directly, at the ratio whose
  ``(1 - ratio)**2`` is the fraction (its achieved fraction is listed).

Calibration reads ``calibration_batches × batch_size`` blocks of the *train*
split and validation scoring (``mix``) 64 blocks of *val*, both evenly spaced
across their split; perplexity
is measured here, apart from optkit, on every block of the val and test splits
(sequence length 128). Run from the repository root::

    .venv/bin/python benchmarks/llm.py

Writes ``benchmarks/results/llm.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import destination, partial_options  # noqa: E402

from optkit.analysis.evaluation import DataReaders  # noqa: E402
from optkit.core.files import write_text  # noqa: E402
from optkit.io.models import load_model  # noqa: E402
from optkit.passes.prune.passes import CALIBRATION_BATCHES, DEEP_CUT, DEEP_CUT_BATCHES, StructuredPrune  # noqa: E402

MODEL = ROOT / "optkit" / "demo" / "python_docs_lm"
RESULTS = ROOT / "benchmarks" / "results"
SEQ_LEN = 128
DEFAULTS = StructuredPrune()
METHODS = {
    "magnitude": {},
    "uniform + refit": {"data": "text", "allocation": "uniform", "importance": "l1"},
    "mix + refit": {"data": "text", "allocation": "sensitivity", "importance": "l1"},
    "mix + refit (unpruned inputs)": {"data": "text", "allocation": "sensitivity", "importance": "l1",
                                      "block_inputs": "unpruned"},
    "default": {"data": "text"},
}
TP_TIME_LIMIT_S = 180


def perplexity(model: torch.nn.Module, blocks: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(perplexity, next-token top-1) over every predicted position of ``blocks`` (padding excluded)."""
    nll, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in blocks:
            logits = model(**batch).logits[:, :-1].float()
            targets = batch["input_ids"][:, 1:]
            mask = batch["attention_mask"][:, 1:].bool()
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            nll += losses[mask].sum().item()
            hits += (logits.argmax(-1) == targets)[mask].sum().item()
            count += mask.sum().item()
    return math.exp(nll / count), hits / count


def split_blocks(model: torch.nn.Module, split: str, batch_size: int = 32,
                 data: str = "text") -> list[dict[str, torch.Tensor]]:
    """Every block of ``split`` of the text spec ``data``, in batches of ``batch_size``."""
    config = model.config
    ids, mask = DataReaders(model).token_blocks(data, split, SEQ_LEN, 10 ** 9, vocab_size=config.vocab_size,
                                                max_positions=config.max_position_embeddings)
    return [{"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size]}
            for i in range(0, len(ids), batch_size)]


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def torch_pruning_row(original: torch.nn.Module, fraction: float) -> tuple[torch.nn.Module | None, dict]:
    """torch-pruning's LLM recipe on a copy at ratio ``1 - sqrt(fraction)``, or the error it gave."""
    from hf_zoo import time_limit, tp_recipe

    model = copy.deepcopy(original)
    ratio = 1 - math.sqrt(fraction)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))}
    try:
        with time_limit(TP_TIME_LIMIT_S):
            tp_recipe(model, "llama", ratio=ratio, inputs=inputs)
    except Exception as e:  # the failure is the measurement
        return None, {"tp_ratio": round(ratio, 4), "error": f"{type(e).__name__}: {str(e).strip()[:160]}"}
    return model, {"tp_ratio": round(ratio, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=lambda v: [float(x) for x in v.split(",")], default=[0.9, 0.8, 0.7, 0.5],
                        help="parameter fractions kept")
    parser.add_argument("--methods", type=lambda v: v.split(","), default=[*METHODS, "torch-pruning"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    out = destination(args.out, partial_options(parser, args, ["fractions", "methods"]))
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "benchmarks"))

    original = load_model(str(MODEL)).eval()
    splits = {split: split_blocks(original, split) for split in ("val", "test")}

    def scored(model: torch.nn.Module, row: dict) -> dict:
        config = model.config
        row.update({"params": params(model), "params_fraction": round(params(model) / params(original), 4),
                    "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                    "hidden": config.hidden_size, "intermediate": config.intermediate_size})
        for split, blocks in splits.items():
            row[f"{split}_perplexity"], row[f"{split}_top1"] = perplexity(model.eval(), blocks)
        print(row, flush=True)
        return row

    rows = [scored(original, {"target": 1.0, "method": "unpruned", "prune_s": 0.0})]
    for fraction in args.fractions:
        for method in args.methods:
            start = time.perf_counter()
            if method == "torch-pruning":
                model, extra = torch_pruning_row(original, fraction)
            else:
                prune = StructuredPrune(target_params=fraction, input_shape=(1, SEQ_LEN), **METHODS[method])
                model, extra = prune.apply(copy.deepcopy(original)).model, {}
            row = {"target": fraction, "method": method, "prune_s": round(time.perf_counter() - start, 1), **extra}
            rows.append(scored(model, row) if model is not None else row)
            if model is None:
                print(row, flush=True)
    record = {"command": "python benchmarks/llm.py " + " ".join(sys.argv[1:]),
              "model": str(MODEL.relative_to(ROOT)), "seq_len": SEQ_LEN, "threads": args.threads,
              "calibration": {"batches": CALIBRATION_BATCHES, "deep_cut_batches": DEEP_CUT_BATCHES,
                              "deep_cut": DEEP_CUT, "batch_size": DEFAULTS.batch_size, "split": "train"},
              "blocks": {s: sum(len(b["input_ids"]) for b in blocks) for s, blocks in splits.items()},
              "machine": f"{platform.machine()}, torch {torch.__version__}", "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "llm.json", json.dumps(record, indent=2) + "\n")
    write_text(out / "llm.md", markdown(record))


def markdown(record: dict) -> str:
    base, calibration = record["rows"][0], record["calibration"]
    lines = ["# Pruning the shipped language model to a parameter target, without training", "",
             f"Command: `{record['command'].strip()}` ({record['threads']} thread; {record['machine']}).", "",
             f"Model: `{record['model']}` ({base['params']:,} parameters: 8 heads sharing 2 KV heads, hidden 256, "
             "MLP 512, 6 blocks, tied embeddings of 4,096 tokens that no method prunes). Nothing is trained after "
             "pruning. optkit's rows keep uniform widths across blocks, so the stock class reloads them. "
             f"Calibration: {calibration['batches']} batches of {calibration['batch_size']} "
             f"({calibration['deep_cut_batches']} batches for {calibration['deep_cut']} of the parameters or fewer) "
             f"blocks of {record['seq_len']} tokens from the train split. Perplexity and next-token top-1 are "
             f"measured by this script on every block of the val ({record['blocks']['val']} blocks) and test "
             f"({record['blocks']['test']} blocks) splits.", "",
             "| params kept (target) | method | params kept | heads / KV / hidden / MLP | val ppl | test ppl | "
             "test top-1 | test ppl × unpruned | s |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in record["rows"]:
        if "test_perplexity" not in row:
            lines.append(f"| {row['target']:g} | {row['method']} | – | – | – | – | – | – | {row['prune_s']:.0f} "
                         f"({row['error']}) |")
            continue
        shape = f"{row['heads']} / {row['kv_heads']} / {row['hidden']} / {row['intermediate']}"
        lines.append(f"| {row['target']:g} | {row['method']} | {row['params_fraction']:.3f} | {shape} | "
                     f"{row['val_perplexity']:.1f} | {row['test_perplexity']:.1f} | {row['test_top1']:.2%} | "
                     f"{row['test_perplexity'] / base['test_perplexity']:.2f} | {row['prune_s']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
