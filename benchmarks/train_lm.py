"""Train the small language model optkit ships: a byte-level BPE tokenizer and a Llama-style causal LM.

Both are trained on the train split of the ``text`` dataset spec (the Python 3.11
documentation's reStructuredText sources, split by file: see
:mod:`optkit.data.text`), on this machine's CPU with at most 2 threads, in about 20
minutes (the learning-rate schedule follows the clock). The model uses grouped-query attention (8 query heads sharing 2
key/value heads), a gated (SwiGLU) MLP and tied input/output embeddings. It is
scored on the val and test splits the way ``optkit optimize --eval text`` scores
it (blocks of ``--seq-len`` tokens, the last one padded; every token but a
block's first is predicted), next to a unigram model fitted on the train split.

Usage (needs `apt-get install python3.11-doc`, which `make data` runs):

    python benchmarks/train_lm.py [--minutes 18] [--threads 2]

Writes the model and its tokenizer to optkit/demo/python_docs_lm/ (save_pretrained, with
the results as its README.md), and benchmarks/results/train-lm.json and train-lm.md.

A differently trained model, to check that what is measured on the shipped one holds elsewhere (other text,
shape and seed), goes to a folder of its own, with its results as its README.md:

    python benchmarks/train_lm.py --data text:DIR --out DIR --seed 1 --sizes hidden_size=192,num_attention_heads=6
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from _results import destination, partial_options  # noqa: E402

from optkit.core.files import write_text  # noqa: E402
from optkit.data.text import load_tokenizer, read_documents, token_blocks, tokenize  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "optkit" / "demo" / "python_docs_lm"
END_OF_TEXT = "<|endoftext|>"
VOCAB_SIZE = 4096
MODEL_SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
               "num_key_value_heads": 2, "max_position_embeddings": 256}
TRAIN_SEQ_LEN = 256
EVAL_SEQ_LENS = (128,)
BATCH_SIZE = 8
PEAK_LR = 2e-3
FINAL_LR_FRACTION = 0.1
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.1
SEED = 0


def train_tokenizer(documents: list[str], folder: Path, max_length: int = MODEL_SIZES["max_position_embeddings"]):
    """A byte-level BPE tokenizer trained on ``documents``, saved in ``folder`` and read back as ``AutoTokenizer`` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                      pad_token=END_OF_TEXT, model_max_length=max_length)
    wrapped.save_pretrained(str(folder))
    return load_tokenizer(folder)


def build_model(tokenizer, sizes: dict[str, int]):
    """The Llama-style causal LM of ``sizes`` (:data:`MODEL_SIZES`' keys), with fresh weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot,
                         pad_token_id=eot, rope_theta=10000.0, **sizes)
    return LlamaForCausalLM(config)


def optimizer_for(model: torch.nn.Module) -> torch.optim.AdamW:
    # Decay the matrices only: norms' gains (1-D) are scales, not weights to shrink.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95))


def model_sizes(text: str) -> dict[str, int]:
    """``--sizes``: ``KEY=N,...`` over :data:`MODEL_SIZES` (argparse reports a bad key or number)."""
    sizes = dict(MODEL_SIZES)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in MODEL_SIZES or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=N with KEY one of {', '.join(MODEL_SIZES)}")
        sizes[key] = int(value)
    return sizes


def text_spec(data: str) -> str:
    """What follows ``text:`` in ``data`` (``""`` for the Python documentation)."""
    kind, _, arg = data.partition(":")
    if kind != "text":
        raise SystemExit(f"--data must be a text spec (text or text:FILE or text:DIR); got {data!r}")
    return arg


def learning_rate(progress: float, step: int) -> float:
    """Linear warm-up over the first steps, then a cosine from the peak down to ``FINAL_LR_FRACTION`` of it.

    ``progress`` is the share of the time budget used: the machine is shared, so the
    schedule follows the clock and ends decayed whatever the load.
    """
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    return PEAK_LR * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model, ids: torch.Tensor, max_steps: int, seconds: float, log, seed: int = SEED) -> dict:
    """AdamW on random windows of the training tokens, bf16 autocast on the CPU, for ``seconds`` (or ``max_steps``)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = optimizer_for(model)
    model.train()
    losses, start, step = [], time.perf_counter(), 0
    while step < max_steps and time.perf_counter() - start < seconds:
        lr = learning_rate((time.perf_counter() - start) / seconds, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(ids) - TRAIN_SEQ_LEN, (BATCH_SIZE,), generator=generator)
        batch = torch.stack([ids[s:s + TRAIN_SEQ_LEN] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(float(loss.detach()))
        if step % 50 == 0:
            log(f"step {step}  loss {sum(losses[-50:]) / len(losses[-50:]):.3f}  lr {lr:.2e}  "
                f"{time.perf_counter() - start:.0f} s")
    model.eval()
    every = 100
    curve = [{"step": i + every, "loss": round(sum(losses[i:i + every]) / len(losses[i:i + every]), 4)}
             for i in range(0, len(losses), every)]
    return {"steps_run": step, "seconds": round(time.perf_counter() - start, 1), "loss_curve": curve,
            "tokens_seen": step * BATCH_SIZE * TRAIN_SEQ_LEN}


@torch.no_grad()
def evaluate(model, blocks, batch_size: int = 16) -> dict:
    """Perplexity and next-token top-1 over the predicted positions (a block's tokens after its first, not padding)."""
    nll, correct, count = 0.0, 0, 0
    for i in range(0, len(blocks.input_ids), batch_size):
        ids = blocks.input_ids[i:i + batch_size]
        mask = blocks.attention_mask[i:i + batch_size]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        targets, scored = ids[:, 1:], mask[:, 1:].bool()
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
        nll -= float(log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[scored].double().sum())
        correct += int((logits[:, :-1].argmax(-1) == targets)[scored].sum())
        count += int(scored.sum())
    return {"perplexity": round(math.exp(nll / count), 4), "next_token_top1": round(correct / count, 4),
            "predicted_tokens": count, "blocks": len(blocks.input_ids)}


def unigram_perplexity(train_ids: torch.Tensor, blocks, vocab: int) -> float:
    """Perplexity of token frequencies from the train split (add-one smoothed), on the same predicted positions."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    log_probs = (counts / counts.sum()).log()
    scored = blocks.attention_mask[:, 1:].bool()
    targets = blocks.input_ids[:, 1:][scored]
    return round(math.exp(-float(log_probs[targets].mean())), 4)


def to_markdown(report: dict) -> str:
    model, training = report["model"], report["training"]
    lines = [f"# {report['title']}", "", f"Command: `{report['command']}`", "",
             f"Measured {report['date']} on this machine's CPU ({report['threads']} threads); torch "
             f"{report['versions']['torch']}, transformers {report['versions']['transformers']}, tokenizers "
             f"{report['versions']['tokenizers']}.", "",
             f"Data: `{report['data_spec']}` (split by file): "
             + ", ".join(f"{s} {d['files']} files / {d['characters']:,} characters / {d['tokens']:,} tokens"
                         for s, d in report["data"].items()) + ".", "",
             f"Tokenizer: byte-level BPE, {report['tokenizer']['vocab_size']:,} tokens, trained in "
             f"{report['tokenizer']['seconds']} s.", "",
             f"Model: LlamaForCausalLM, {model['parameters']:,} parameters ({model['hidden_size']} hidden, "
             f"{model['num_hidden_layers']} layers, {model['num_attention_heads']} heads sharing "
             f"{model['num_key_value_heads']} KV heads, gated MLP of {model['intermediate_size']}, tied embeddings, "
             f"{model['max_position_embeddings']} positions).", "",
             f"Training: {training['steps_run']} steps of {BATCH_SIZE}×{TRAIN_SEQ_LEN} tokens "
             f"({training['tokens_seen']:,} tokens), AdamW (peak lr {PEAK_LR:g}, {WARMUP_STEPS} warm-up steps, then a "
             f"cosine to {FINAL_LR_FRACTION:g}× over the {training['seconds']:.0f} s budget, weight decay "
             f"{WEIGHT_DECAY:g}), bf16 autocast; whole script {report['seconds']:.0f} s. The schedule follows the "
             "clock (the machine is shared), so the step count depends on the load "
             f"(1-minute load average {report['load_avg_1min_end']} at the end).", "",
             "| split | seq len | perplexity | next-token top-1 | unigram perplexity | predicted tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in report["scores"]:
        lines.append(f"| {row['split']} | {row['seq_len']} | {row['perplexity']:.3f} | {row['next_token_top1']:.2%} | "
                     f"{row['unigram_perplexity']:.3f} | {row['predicted_tokens']:,} |")
    lines += ["", "Perplexity is exp of the mean next-token negative log-likelihood over the predicted positions "
              "(every token of a block but its first, padding excluded), as `optkit optimize --eval text` "
              "computes it; the unigram model predicts each token by its train-split frequency."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=18.0, help="Training time (the schedule follows the clock).")
    parser.add_argument("--max-steps", type=int, default=100_000, help="Stop after this many optimizer steps.")
    # On a busy machine one thread trains faster than two: with the cores oversubscribed, each
    # of torch's threads waits for the other at every op (measured: 1.7 s vs 7.3 s per step).
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 when other work keeps the cores busy).")
    parser.add_argument("--data", default="text", help="the text data spec to train on (default: %(default)s, the "
                        "Python documentation)")
    parser.add_argument("--out", type=Path, default=OUT, help="the model's folder (default: the shipped model's)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the weights and of the training windows")
    parser.add_argument("--sizes", type=model_sizes, default=MODEL_SIZES,
                        help="comma-separated KEY=N overriding the shipped model's sizes, e.g. hidden_size=192")
    args = parser.parse_args()
    spec = text_spec(args.data)
    # Not the shipped model's training: its model and results go elsewhere (see _results.py).
    partial = partial_options(parser, args, ["minutes", "max_steps", "data", "seed", "sizes"])
    out, results = destination(args.out, partial, committed=OUT), destination(RESULTS, partial)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise SystemExit(f"{out} holds files that are not a model this script wrote; give an empty or new --out")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {line}", flush=True)

    documents = {split: read_documents(spec, split) for split in ("train", "val", "test")}
    with tempfile.TemporaryDirectory(prefix="optkit-lm-") as scratch:
        folder = Path(scratch)
        tokenizer_start = time.perf_counter()
        tokenizer = train_tokenizer(documents["train"], folder, args.sizes["max_position_embeddings"])
        tokenizer_seconds = round(time.perf_counter() - tokenizer_start, 1)
        log(f"tokenizer: {len(tokenizer)} tokens in {tokenizer_seconds} s")
        train_ids = torch.tensor(tokenize(tokenizer, documents["train"]), dtype=torch.long)
        model = build_model(tokenizer, args.sizes)
        parameters = sum(p.numel() for p in model.parameters())
        log(f"model: {parameters:,} parameters; {len(train_ids):,} training tokens")
        training = train(model, train_ids, args.max_steps, args.minutes * 60, log, args.seed)
        model.save_pretrained(str(folder), safe_serialization=True)
        scores = []
        for split in ("val", "test"):
            for seq_len in EVAL_SEQ_LENS:
                blocks = token_blocks(spec, split, folder, seq_len)
                row = {"split": split, "seq_len": seq_len, **evaluate(model, blocks),
                       "unigram_perplexity": unigram_perplexity(train_ids, blocks, len(tokenizer))}
                scores.append(row)
                log(f"{split} @ {seq_len}: perplexity {row['perplexity']:.3f} (unigram {row['unigram_perplexity']:.3f}), "
                    f"next-token top-1 {row['next_token_top1']:.2%}")
        data = {}
        for split, docs in documents.items():
            data[split] = {"files": len(docs), "characters": sum(map(len, docs)),
                           "tokens": len(train_ids) if split == "train" else len(tokenize(tokenizer, docs))}
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(folder, out)
    import tokenizers
    import transformers

    report = {
        "command": "python " + " ".join(["benchmarks/train_lm.py", *sys.argv[1:]]),
        "title": ("The shipped language model: optkit/demo/python_docs_lm" if not partial
                  else f"A language model trained by benchmarks/train_lm.py: {out}"),
        "data_spec": args.data,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "load_avg_1min_end": round(os.getloadavg()[0], 2),
        "data": data,
        "tokenizer": {"kind": "byte-level BPE", "vocab_size": len(tokenizer), "seconds": tokenizer_seconds},
        "model": {"class": "LlamaForCausalLM", "parameters": parameters, "vocab_size": len(tokenizer),
                  "tie_word_embeddings": True, "seed": args.seed, **args.sizes},
        "training": {**training, "batch_size": BATCH_SIZE, "seq_len": TRAIN_SEQ_LEN, "peak_lr": PEAK_LR,
                     "warmup_steps": WARMUP_STEPS, "weight_decay": WEIGHT_DECAY, "autocast": "bf16"},
        "scores": scores,
        "seconds": round(time.perf_counter() - start, 1),
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir())},
    }
    results.mkdir(parents=True, exist_ok=True)
    write_text(results / "train-lm.json", json.dumps(report, indent=1) + "\n")
    markdown = to_markdown(report)
    write_text(results / "train-lm.md", markdown)
    # The model card beside the weights: how they were made, and what they score.
    write_text(out / "README.md", markdown)
    log(f"wrote {out} and {results / 'train-lm.json'}")


if __name__ == "__main__":
    main()
