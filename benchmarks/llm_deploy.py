"""The shipped language model pruned, recovered by a short distillation, and deployed: perplexity and tokens/s (#30).

Three parts, each run alone on a quiet machine (``--parts``):

* ``recovery``: the model pruned to each fraction of its parameters with the
  recommended path (``--allocation sensitivity --calib-data text``: heads/MLP
  split by validation perplexity, least-squares refit), then distilled from the
  unpruned model on the train split for a fixed number of steps (the command
  line it equals is recorded), timed, and scored on every test block; the
  unpruned model trained the same way is the control row (params kept 1).
* ``speed``: the unpruned model and each pruned one written by the CLI
  (``optkit export`` / ``optkit optimize ... --export onnx --int8 --calib-data
  text``): ``model.onnx`` and its INT8 file timed on a prefill of 128 tokens,
  the decode graphs (FP32 and INT8) per generated token with a KV cache after a
  128-token prompt, and PyTorch eager decode, at batch 1, 1 and 2 threads, the
  files of one measurement interleaved; each ONNX file's perplexity on every
  test block, computed here with ONNX Runtime.
* ``candidates`` (#45): every deployment ``--deploy`` tries for a language
  model (ONNX Runtime FP32, dynamic INT8, weight-only INT8/INT4 with
  MatMulNBits; OpenVINO f32, bf16, NNCF weight compression INT8/INT4), built and
  checked as ``--deploy`` builds them (validation perplexity against each
  precision's limit, the decode graph too), each scored on every test block and
  timed: prefill of 128 tokens (interleaved blocks, one session alive at a time)
  and decode per token after a 128-token prompt (the decode graphs taking turns),
  batch 1, at each thread count; INT4 at each ``--block-sizes``.

A run of some parts keeps the other parts' figures in the JSON (the Markdown is
written from all of them). Run from the repository root::

    .venv/bin/python benchmarks/llm_deploy.py

Writes ``benchmarks/results/llm-deploy.{json,md}`` and ``llm.png`` (with the
no-training figures of ``llm.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import destination, partial_options  # noqa: E402
from llm import MODEL, SEQ_LEN, params, perplexity, split_blocks  # noqa: E402
from optkit.core.files import write_text  # noqa: E402
from optkit.io.models import load_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OPTKIT = [sys.executable, "-m", "optkit"]
PRUNE_FLAGS = ["--allocation", "sensitivity", "--calib-data", "text"]
#: Uniform widths (every head group and MLP loses the same fraction): what a stock config can describe.
UNIFORM_FLAGS = ["--calib-data", "text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=lambda v: v.split(","), default=["recovery", "speed"])
    parser.add_argument("--fractions", type=lambda v: [float(x) for x in v.split(",")], default=[0.8, 0.7, 0.5])
    parser.add_argument("--steps", type=int, default=300, help="distillation steps")
    parser.add_argument("--batch-size", type=int, default=32, help="distillation batch (blocks of 128 tokens)")
    parser.add_argument("--lrs", type=lambda v: [float(x) for x in v.split(",")], default=[3e-4],
                        help="distillation learning rates (each fraction is distilled once per rate)")
    parser.add_argument("--uniform-fractions", type=lambda v: [float(x) for x in v.split(",") if x], default=[0.7],
                        help="params kept by the uniform-width models timed beside the mixed ones")
    parser.add_argument("--threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    parser.add_argument("--block-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[32, 128],
                        help="weight-only INT4 block (group) sizes of the candidates part; the first is --deploy's")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # Fewer steps, thread counts or INT4 block sizes than the committed run: written elsewhere (see _results.py).
    args.out = destination(args.out, partial_options(parser, args, ["steps", "threads", "block_sizes"]))
    path = args.out / "llm-deploy.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update({"model": str(MODEL.relative_to(ROOT)), "seq_len": SEQ_LEN,
                   "machine": f"{platform.machine()}, {_cpu()}, torch {torch.__version__}"})
    original = load_model(str(MODEL)).eval()
    test = split_blocks(original, "test")
    record["test_blocks"] = sum(len(b["input_ids"]) for b in test)
    if "recovery" in args.parts:
        fresh = recovery(original, test, args)
        keys = {_recovery_key(row) for row in fresh["rows"]}
        kept = [row for row in (record.get("recovery") or {}).get("rows", []) if _recovery_key(row) not in keys]
        fresh["rows"] = sorted(kept + fresh["rows"], key=lambda row: (-row["target"], row["lr"]))
        record["recovery"] = fresh
        _save(args.out, record)
    if "speed" in args.parts:
        record["speed"] = speed(original, test, args)
        _save(args.out, record)
    if "candidates" in args.parts:
        record["candidates"] = candidates(original, test, args)
        _save(args.out, record)


def _recovery_key(row: dict) -> tuple:
    """Rows of earlier runs are kept unless a run measures the same fraction, rate, steps and batch again."""
    return row["target"], row["lr"], row["steps"], row["batch_size"]


def recovery(original: torch.nn.Module, test: list[dict], args) -> dict:
    """Each fraction pruned by the recommended path, then distilled; test perplexity before and after."""
    from optkit.passes.finetune.passes import FineTune
    from optkit.passes.prune.passes import StructuredPrune

    torch.set_num_threads(max(args.threads))
    unpruned, _ = perplexity(original, test)
    rows = []
    # The unpruned model trained the same way is the control: the shipped model is small and briefly trained,
    # so more steps on the train split may lower its perplexity whether or not it was pruned.
    for fraction in [1.0, *args.fractions]:
        pruned = (copy.deepcopy(original) if fraction >= 1 else
                  StructuredPrune(target_params=fraction, input_shape=(1, SEQ_LEN), data="text",
                                  allocation="sensitivity").apply(copy.deepcopy(original)).model)
        before, before_top1 = perplexity(pruned.eval(), test)
        for lr in args.lrs:
            load = os.getloadavg()[0]
            start = time.perf_counter()
            tune = FineTune(data="text", distill=True, teacher=original, lr=lr, batch_size=args.batch_size,
                            max_steps=args.steps, input_shape=(1, SEQ_LEN))
            tuned = tune.apply(copy.deepcopy(pruned)).model.eval()
            seconds = time.perf_counter() - start
            after, after_top1 = perplexity(tuned, test)
            row = {"target": fraction, "params_fraction": round(params(tuned) / params(original), 4), "lr": lr,
                   "steps": args.steps, "batch_size": args.batch_size, "seconds": round(seconds, 1),
                   "load_avg_1min_at_start": round(load, 2), "test_ppl_pruned": before,
                   "test_top1_pruned": before_top1, "test_ppl_distilled": after, "test_top1_distilled": after_top1,
                   "ratio_pruned": before / unpruned, "ratio_distilled": after / unpruned,
                   "command": " ".join(["optkit optimize", str(MODEL.relative_to(ROOT)),
                                        *(["--target-params", f"{fraction:g}", *PRUNE_FLAGS] if fraction < 1 else []),
                                        "--finetune text --distill --batch-size", str(args.batch_size), "--lr",
                                        f"{lr:g}", "--max-steps", str(args.steps)])}
            print(row, flush=True)
            rows.append(row)
    return {"unpruned_test_ppl": unpruned, "threads": max(args.threads), "rows": rows}


def speed(original: torch.nn.Module, test: list[dict], args) -> dict:
    """The CLI's files for the unpruned and each pruned model, timed and scored."""
    from optkit.analysis.latency import interleaved_latency
    from optkit.export import decode
    from optkit.passes.quantize.paths import decode_int8_path

    with tempfile.TemporaryDirectory(prefix="llm-deploy-") as scratch:
        folders = {"unpruned": Path(scratch) / "unpruned"}
        _run([*OPTKIT, "export", str(MODEL), "--onnx", str(folders["unpruned"] / "model.onnx"), "--int8",
              "--calib-data", "text"])
        variants = [("mix", f, PRUNE_FLAGS) for f in args.fractions] + [
            ("uniform", f, UNIFORM_FLAGS) for f in args.uniform_fractions]
        for allocation, fraction, flags in variants:
            name = f"{allocation} {fraction:g}"
            folders[name] = Path(scratch) / name.replace(" ", "-")
            _run([*OPTKIT, "optimize", str(MODEL), "--target-params", f"{fraction:g}", *flags,
                  "--export", "onnx", "--int8", "--no-latency", "--out", str(folders[name])])
        models = {name: load_model(str(folder if name != "unpruned" else MODEL)).eval()
                  for name, folder in folders.items()}
        files = {(name, precision): folder / f"model{'' if precision == 'fp32' else '.int8'}.onnx"
                 for name, folder in folders.items() for precision in ("fp32", "int8")}
        decode_files = {(name, precision): (decode.decode_path if precision == "fp32" else decode_int8_path)(
            folders[name] / "model.onnx") for name, precision in files}
        rows = {f"{name} {precision}": {"model": name, "precision": precision,
                                        "params_fraction": round(params(models[name]) / params(original), 4),
                                        "test_ppl": onnx_perplexity(path, test), "file_size": path.stat().st_size}
                for (name, precision), path in files.items()}
        for threads in args.threads:
            load = _settled_load()
            prefill = interleaved_latency(list(files.values()), (1, SEQ_LEN), threads=threads, warmup=3, repeats=30)
            decoded = decode.onnx_decode_speed(list(decode_files.values()), threads=threads)
            eager = torch_decode(models, threads)
            for key, timed, onnx_decode in zip(rows, prefill, decoded):
                rows[key][f"threads_{threads}"] = {
                    "load_avg_1min": load, "prefill_ms": timed.median_ms,
                    "prefill_tokens_per_s": round(SEQ_LEN / timed.median_ms * 1e3, 1),
                    "decode_tokens_per_s": onnx_decode["tokens_per_s"],
                    "pytorch_decode_tokens_per_s": eager[rows[key]["model"]] if rows[key]["precision"] == "fp32"
                    else None}
                print(key, rows[key], flush=True)
    return {"threads": args.threads, "prompt_tokens": decode.PROMPT_TOKENS, "rows": list(rows.values()),
            "commands": {"unpruned": f"optkit export {MODEL.relative_to(ROOT)} --onnx DIR/model.onnx --int8 "
                                     "--calib-data text",
                         "pruned": f"optkit optimize {MODEL.relative_to(ROOT)} --target-params F "
                                   f"{' '.join(PRUNE_FLAGS)} --export onnx --int8 --out DIR",
                         "uniform": f"optkit optimize {MODEL.relative_to(ROOT)} --target-params F "
                                    f"{' '.join(UNIFORM_FLAGS)} --export onnx --int8 --out DIR"}}


def candidates(original: torch.nn.Module, test: list[dict], args) -> dict:
    """Every deployment ``--deploy`` tries for the unpruned model, built and checked as it builds them, scored on
    the test split and timed at each thread count; and what ``--deploy``'s rule chooses among them."""
    from optkit.analysis.latency import Deployment, interleaved_latency
    from optkit.core.errors import DataError, ExportError
    from optkit.passes.deploy import DeploySettings, pick
    from optkit.passes.deploy import tokens as token_deploy
    from optkit.passes.deploy.choose import Candidate
    from optkit.passes.deploy.settings import TOKEN_CANDIDATES

    rows: list[dict] = []
    built: list[Candidate] = []
    with tempfile.TemporaryDirectory(prefix="llm-candidates-") as scratch:
        source = Path(scratch) / "model.onnx"
        _run([*OPTKIT, "export", str(MODEL), "--onnx", str(source)])
        for index, block in enumerate(args.block_sizes):
            folder = Path(scratch) / f"block-{block}"
            folder.mkdir()
            settings = DeploySettings(calib_data="text", weight_block_size=block)
            builder = token_deploy.TokenCandidates(source, folder, settings, (1, SEQ_LEN), original)
            names = TOKEN_CANDIDATES if index == 0 else [n for n in TOKEN_CANDIDATES if n.endswith("-w4")]
            for name in names:
                candidate = Candidate(name, *name.split("-"))
                start = time.perf_counter()
                try:
                    builder.build(candidate)
                except (ExportError, DataError) as e:
                    candidate.status, candidate.reason = "refused", str(e)
                row = {"name": name, "label": candidate.label, "block_size": block if name.endswith("-w4") else None,
                       "status": candidate.status, "reason": candidate.reason, "build_check_s":
                       round(time.perf_counter() - start, 1), "check": candidate.check}
                if candidate.status == "verified":
                    row["test_ppl"] = onnx_perplexity(candidate.built, test)
                    built.append(candidate)
                print(name, block, {k: v for k, v in row.items() if k != "check"}, flush=True)
                rows.append(row)
        timed_rows = [r for r in rows if r["status"] == "verified"]
        for threads in args.threads:
            load = _settled_load()
            prefill = interleaved_latency([Deployment(c.built, c.runtime, c.precision) for c in built],
                                          (1, SEQ_LEN), threads=threads, warmup=3, repeats=30)
            load_mid = round(os.getloadavg()[0], 2)
            decoded = token_deploy.decode_timer([c.decode_built for c in built], prompt_tokens=SEQ_LEN,
                                                threads=threads)
            for row, timed, speed in zip(timed_rows, prefill, decoded):
                row[f"threads_{threads}"] = {"load_avg_1min": [load, load_mid, round(os.getloadavg()[0], 2)],
                                             "prefill_ms": timed.median_ms,
                                             "prefill_tokens_per_s": round(SEQ_LEN / timed.median_ms * 1e3, 1),
                                             "decode_ms": speed["median_ms"],
                                             "decode_tokens_per_s": speed["tokens_per_s"]}
                print(row["name"], row["block_size"], threads, row[f"threads_{threads}"], flush=True)
    threads = max(args.threads)
    first = [c for c, r in zip(built, timed_rows) if r["block_size"] in (None, args.block_sizes[0])]
    for candidate, row in zip(built, timed_rows):
        candidate.latency = {"median_ms": row[f"threads_{threads}"]["decode_ms"]}
    chosen = pick(first, 0.02) if first else None
    return {"threads": args.threads, "prompt_tokens": SEQ_LEN, "block_sizes": args.block_sizes,
            "limits": token_deploy.limits(), "rows": rows, "chosen": chosen.name if chosen else None,
            "machine": f"{platform.machine()}, {_cpu()}, torch {torch.__version__}",
            "command": f"optkit optimize {MODEL.relative_to(ROOT)} --export onnx --deploy --calib-data text"}


def torch_decode(models: dict[str, torch.nn.Module], threads: int, rounds: int = 3) -> dict[str, float]:
    """PyTorch eager decode tokens/s per model, the models taking turns round by round (median of rounds)."""
    from optkit.export.decode import torch_decode_speed

    torch.set_num_threads(threads)
    per_round: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            per_round[name].append(torch_decode_speed(model, rounds=1)["tokens_per_s"])
    return {name: float(np.median(values)) for name, values in per_round.items()}


def onnx_perplexity(path: Path, blocks: list[dict]) -> float:
    """exp(mean next-token NLL) of an ONNX file over the blocks (padding excluded), computed with ONNX Runtime (an
    OpenVINO IR, ``.xml``, with OpenVINO at the precision it records)."""
    import onnxruntime as ort

    from optkit.runtime import openvino as ov

    session = (ov.session(path) if Path(path).suffix == ".xml" else
               ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    nll, count = 0.0, 0
    for batch in blocks:
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
        logits = session.run(None, {"input_ids": ids, "attention_mask": mask})[0][:, :-1].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        targets = ids[:, 1:]
        picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
        scored = mask[:, 1:].astype(bool)
        nll -= picked[scored].sum()
        count += scored.sum()
    return float(np.exp(nll / count))


def _settled_load(below: float = 0.5, patience_s: float = 180.0) -> float:
    """The 1-minute load average once this script's own preceding work (CLI runs, scoring) has decayed from it
    (below ``below``, or after ``patience_s``): what a timing block starts on."""
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


def _run(command: list[str]) -> None:
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def _cpu() -> str:
    """The CPU's name with its family/model numbers and the instruction sets INT8 and bf16 speed depend on."""
    from optkit.analysis.latency import cpu_model

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return cpu_model()
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return (f"{cpu_model()} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; "
            f"{' '.join(isa) or 'no AVX2'}; {os.cpu_count()} logical CPUs)")


def _save(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record["command"] = "python benchmarks/llm_deploy.py " + " ".join(sys.argv[1:])
    write_text(out / "llm-deploy.json", json.dumps(record, indent=2) + "\n")
    write_text(out / "llm-deploy.md", markdown(record))
    no_training = out / "llm.json"
    if no_training.is_file():
        plot(json.loads(no_training.read_text()), record, out / "llm.png")


def markdown(record: dict) -> str:
    lines = ["# The shipped language model: distillation after pruning, and speed in deployment", "",
             f"Model: `{record['model']}`; {record['machine']}. Perplexity on every block of the test split "
             f"({record['test_blocks']} blocks of {record['seq_len']} tokens), computed by the script. "
             f"Last command: `{record['command'].strip()}`.", ""]
    recovery_part = record.get("recovery")
    if recovery_part:
        lines += ["## Recovery: distillation from the unpruned model", "",
                  f"Unpruned test perplexity {recovery_part['unpruned_test_ppl']:.2f}; "
                  f"{recovery_part['threads']} threads. Each row's command is in `llm-deploy.json`.", "",
                  "| params kept | lr | steps × batch | seconds | load at start | test ppl pruned | × unpruned | "
                  "test ppl distilled | × unpruned |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in recovery_part["rows"]:
            lines.append(f"| {row['params_fraction']:.3f} | {row['lr']:g} | {row['steps']} × {row['batch_size']} | "
                         f"{row['seconds']:.0f} | {row['load_avg_1min_at_start']:.2f} | "
                         f"{row['test_ppl_pruned']:.2f} | {row['ratio_pruned']:.3f} | "
                         f"{row['test_ppl_distilled']:.2f} | {row['ratio_distilled']:.3f} |")
        lines.append("")
    speed_part = record.get("speed")
    if speed_part:
        lines += ["## Speed at batch 1: prefill of 128 tokens and decode with a KV cache", "",
                  f"Decode is timed per generated token after a {speed_part['prompt_tokens']}-token prompt. "
                  "ONNX Runtime files of one thread count are timed interleaved (pools not spinning); PyTorch "
                  "eager models take turns. Commands: "
                  f"`{speed_part['commands']['unpruned']}`; mix (the measured per-layer allocation): "
                  f"`{speed_part['commands']['pruned']}`; uniform widths: "
                  f"`{speed_part['commands'].get('uniform', '–')}`.", ""]
        header = "| model | precision | params kept | test ppl | file bytes |"
        rule = "|---|---|---:|---:|---:|"
        for threads in speed_part["threads"]:
            header += (f" prefill tok/s ({threads}t) | × unpruned | decode tok/s ONNX ({threads}t) | × unpruned | "
                       f"decode tok/s PyTorch ({threads}t) |")
            rule += "---:|---:|---:|---:|---:|"
        lines += [header, rule]
        base = {row["precision"]: row for row in speed_part["rows"] if row["model"] == "unpruned"}
        for row in speed_part["rows"]:
            line = (f"| {row['model']} | {row['precision']} | {row['params_fraction']:.3f} | {row['test_ppl']:.2f} | "
                    f"{row['file_size']:,} |")
            for threads in speed_part["threads"]:
                timed, unpruned = row[f"threads_{threads}"], base[row["precision"]][f"threads_{threads}"]
                eager = timed["pytorch_decode_tokens_per_s"]
                line += (f" {timed['prefill_tokens_per_s']:,.0f} | "
                         f"{timed['prefill_tokens_per_s'] / unpruned['prefill_tokens_per_s']:.2f} | "
                         f"{timed['decode_tokens_per_s']:,.0f} | "
                         f"{timed['decode_tokens_per_s'] / unpruned['decode_tokens_per_s']:.2f} | "
                         f"{'–' if eager is None else f'{eager:,.0f}'} |")
            lines.append(line)
        loads = sorted({row[f"threads_{t}"]["load_avg_1min"] for row in speed_part["rows"]
                        for t in speed_part["threads"]})
        int8_lines = []
        for threads in speed_part["threads"]:
            fp32, int8 = (base[p][f"threads_{threads}"] for p in ("fp32", "int8"))
            int8_lines.append(f"{threads} thread(s): prefill {int8['prefill_tokens_per_s'] / fp32['prefill_tokens_per_s']:.2f}×, "
                              f"decode {int8['decode_tokens_per_s'] / fp32['decode_tokens_per_s']:.2f}×")
        lines += ["", f"Unpruned INT8 over FP32: test perplexity {base['int8']['test_ppl'] / base['fp32']['test_ppl']:.4f}×; "
                  + "; ".join(int8_lines) + ".",
                  "", "× unpruned compares with the unpruned model of the same precision (INT8 with INT8).",
                  f"Load average (1 min) before each timing block, after waiting for this script's own CLI runs and "
                  f"scoring to decay from it: {', '.join(map(str, loads))}. Machine: {record['machine']}."]
    if record.get("candidates"):
        lines += candidates_markdown(record["candidates"], record["candidates"].get("machine", record["machine"]))
    return "\n".join(lines) + "\n"


def candidates_markdown(part: dict, machine: str) -> list[str]:
    """The candidates part: each deployment's check, test perplexity and tokens/s against ONNX Runtime FP32."""
    limits = ", ".join(f"{k} {v:g}×" for k, v in part["limits"].items())
    lines = ["", "## Deployment candidates of the unpruned model (`--deploy` on a language model, #45)", "",
             f"Each candidate is built and checked as `{part['command']}` builds it: validation perplexity (the "
             f"first 8,192 tokens of the val split) at most its precision's limit times the FP32 ONNX file's "
             f"({limits}; `w8`/`w4`: weight-only INT8/INT4), the decode graph's over 8 prompts × 16 text tokens "
             "too. Test perplexity on every test block. Batch 1: prefill of 128 tokens (interleaved blocks, one "
             f"session alive at a time) and decode per token after a {part['prompt_tokens']}-token prompt (decode "
             "graphs taking turns, 5 rounds of 32 steps, one session alive at a time); × is over ONNX Runtime "
             "FP32 at the same thread count. INT4: ONNX Runtime MatMulNBits symmetric (accuracy level 4), NNCF "
             "INT4_SYM (embeddings and last layer INT8); block size in brackets.", ""]
    header = "| candidate | status | val ppl × FP32 (limit) | decode graph × FP32 | test ppl | × FP32 | bytes |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    for threads in part["threads"]:
        header += f" prefill tok/s ({threads}t) | × | decode tok/s ({threads}t) | × |"
        rule += "---:|---:|---:|---:|"
    lines += [header, rule]
    base = next(r for r in part["rows"] if r["name"] == "onnxruntime-fp32")
    for row in part["rows"]:
        check = row["check"] or {}
        name = row["name"] + (f" ({row['block_size']})" if row["block_size"] else "")
        if row["status"] != "verified":
            lines.append(f"| {name} | {row['status']}: {row['reason']} |" + " |" * (5 + 4 * len(part["threads"])))
            continue
        ratio = check.get("perplexity_ratio")
        decode_ratio = (check.get("decode") or {}).get("perplexity_ratio")
        line = (f"| {name} | verified | {ratio:.4f} ({check['limit']:g}) | "
                f"{'–' if decode_ratio is None else f'{decode_ratio:.4f}'} | {row['test_ppl']:.2f} | "
                f"{row['test_ppl'] / base['test_ppl']:.4f} | {check['file_size']:,} |")
        for threads in part["threads"]:
            timed, fp32 = row[f"threads_{threads}"], base[f"threads_{threads}"]
            line += (f" {timed['prefill_tokens_per_s']:,.0f} | "
                     f"{timed['prefill_tokens_per_s'] / fp32['prefill_tokens_per_s']:.2f} | "
                     f"{timed['decode_tokens_per_s']:,.0f} | "
                     f"{timed['decode_tokens_per_s'] / fp32['decode_tokens_per_s']:.2f} |")
        lines.append(line)
    int4 = [r for r in part["rows"] if r["name"].endswith("-w4") and r["status"] == "verified"]
    loads = sorted({x for r in part["rows"] for t in part["threads"] if f"threads_{t}" in r
                    for x in r[f"threads_{t}"]["load_avg_1min"]})
    lines += ["", f"`--deploy`'s rule on these figures ({max(part['threads'])} threads, decode step, 2% minimum "
              f"gain, INT4 at block {part['block_sizes'][0]}): **{part['chosen']}**."]
    for threads in part["threads"]:
        best = max(int4, key=lambda r: r[f"threads_{threads}"]["decode_tokens_per_s"], default=None)
        if best is None:
            continue
        gain = best[f"threads_{threads}"]["decode_tokens_per_s"] / base[f"threads_{threads}"]["decode_tokens_per_s"]
        ratio = best["test_ppl"] / base["test_ppl"]
        lines.append(f"Fastest weight-only INT4 at {threads} thread(s): {best['name']} (block {best['block_size']}), "
                     f"decode {gain:.2f}× ONNX Runtime FP32 at test perplexity {ratio:.4f}× (the #45 target, ≥ 2× "
                     f"at ≤ 1.05×: {'met' if gain >= 2 and ratio <= 1.05 else 'not met'}).")
    openvino = [r for r in part["rows"] if r["name"].startswith("openvino") and r["status"] == "verified"]
    if openvino:
        threads = max(part["threads"])
        lines.append(f"OpenVINO prefills {min(r[f'threads_{threads}']['prefill_ms'] for r in openvino):.1f}–"
                     f"{max(r[f'threads_{threads}']['prefill_ms'] for r in openvino):.1f} ms at a fixed shape but "
                     f"takes {min(r[f'threads_{threads}']['decode_ms'] for r in openvino):.1f}–"
                     f"{max(r[f'threads_{threads}']['decode_ms'] for r in openvino):.1f} ms a decode step "
                     f"({threads} threads): the decode graph's inputs change shape every step (the cache grows by "
                     "one token), and in a separate check OpenVINO took about 3× as long per call on a growing cache "
                     "as on a repeated shape; on this small model that cost outweighs the arithmetic, so --deploy "
                     "refuses OpenVINO for decode here (a stateful OpenVINO graph, the cache kept inside, is not "
                     "built yet).")
    lines += ["", f"Load average (1 min) before, between and after the timing blocks: {', '.join(map(str, loads))}; "
              f"machine: {machine}. A load above the thread count means other work shared the cores: such "
              "figures are indicative only."]
    return lines


def plot(no_training: dict, record: dict, path: Path) -> None:
    """Test perplexity × unpruned against parameters kept, per method; tokens/s per model at 2 threads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    base = no_training["rows"][0]["test_perplexity"]
    for method in ("magnitude", "uniform + refit", "mix + refit"):
        rows = [r for r in no_training["rows"] if r["method"] == method and "test_perplexity" in r]
        left.plot([r["params_fraction"] for r in rows], [r["test_perplexity"] / base for r in rows], "o-",
                  label=f"{method}, no training")
    for lr in sorted({r["lr"] for r in (record.get("recovery") or {}).get("rows", [])}):
        rows = [r for r in record["recovery"]["rows"] if r["lr"] == lr]
        left.plot([r["params_fraction"] for r in rows], [r["ratio_distilled"] for r in rows], "s--",
                  label=f"mix + refit, distilled {rows[0]['steps']} steps (lr {lr:g})")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="parameters kept", ylabel="test perplexity × unpruned", title="Quality")
    left.invert_xaxis()
    left.legend(fontsize=7)
    speed_part = record.get("speed")
    if speed_part:
        threads = max(speed_part["threads"])
        rows = speed_part["rows"]
        labels = [f"{r['model']}\n{r['precision']}" for r in rows]
        x = np.arange(len(rows))
        right.bar(x - 0.2, [r[f"threads_{threads}"]["prefill_tokens_per_s"] / 10 for r in rows], 0.4,
                  label="prefill tokens/s ÷ 10")
        right.bar(x + 0.2, [r[f"threads_{threads}"]["decode_tokens_per_s"] for r in rows], 0.4,
                  label="decode tokens/s")
        right.set_xticks(x, labels, fontsize=7)
        right.set(title=f"ONNX Runtime, batch 1, {threads} threads")
        right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
