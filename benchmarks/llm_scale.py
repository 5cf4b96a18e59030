"""Time and peak memory of ``optkit optimize`` on language models of released sizes; what 8 B / 70 B would need (#43).

Random-weight Hugging Face models built offline from the published configs
(sizes, heads, vocabulary, tied embeddings, RoPE settings; the token ids are
the trained tokenizer's), saved in bf16 as released checkpoints are:

* ``smollm2-135m`` (HuggingFaceTB/SmolLM2-135M, LlamaForCausalLM),
* ``qwen2.5-0.5b`` (Qwen/Qwen2.5-0.5B, Qwen2ForCausalLM),
* ``llama-3.2-1b`` (meta-llama/Llama-3.2-1B, LlamaForCausalLM, llama3 RoPE scaling),
* ``llama-3-8b-wide`` (meta-llama/Meta-Llama-3-8B's widths: hidden 4096, 32 heads,
  8 KV heads, MLP 14336, vocabulary 128256, untied head) truncated to
  ``--wide-blocks`` blocks, for the time and memory one 8 B block costs.

Each folder (``save_pretrained``, safetensors) gets a byte-level BPE tokenizer
trained with ``tokenizers`` on the Python 3.11 documentation sources
(``python3.11-doc``), saved as ``tokenizer.json`` + ``tokenizer_config.json``
so ``AutoTokenizer`` and optkit's ``text:FILE`` spec find it beside the config.
The calibration file is a fixed cut of the same documentation: the files
under ``library/`` in path order, whole, until 1,700,000 bytes are reached.

Each model runs exactly what a user runs, in a fresh process::

    optkit optimize DIR --target-params 0.8 --calib-data text:FILE --out OUT --force

(``python -m optkit`` from ``--optkit-root``, so another checkout's code can be
measured), timing its wall time, polling the RSS of its process tree every
0.1 s (and ``ru_maxrss`` of ``getrusage(RUSAGE_CHILDREN)`` in a measuring
process of its own), reading the per-pass seconds from ``OUT/report.json``
and taking each stage's peak RSS from the samples between the stage lines
optkit prints. The result's parameters, dtypes and sizes are read from its
safetensors headers here, independently of optkit.

Rows accumulate in the JSON keyed by ``--label`` + model + variant, so two code
versions (``before`` / ``after``) sit side by side in the Markdown and PNG.
Run from the repository root, one heavy job at a time::

    .venv/bin/python benchmarks/llm_scale.py --label before --optkit-root /tmp/optkit-before
    .venv/bin/python benchmarks/llm_scale.py --label after
    .venv/bin/python benchmarks/llm_scale.py --quick        # smoke run, results in a temporary folder

Writes ``benchmarks/results/llm-scale.{json,md,png}`` (``--quick`` never does).
Models, tokenizer and calibration text are cached under ``--cache``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NAME = "llm-scale"
DOCS = Path("/usr/share/doc/python3.11/html/_sources")
CALIB_SUBDIR = "library"
CALIB_BYTES = 1_700_000
TOKENIZER_VOCAB = 32768
END_OF_TEXT = "<|endoftext|>"
SEED = 0
TARGET_PARAMS = 0.8
POLL_S = 0.1
NOTES_KEPT = 3
GB = 1e9
# Memory wanted free before a run: the line the first measurements (before, bf16) drew, with some margin.
MEMORY_PER_CHECKPOINT_BYTE = 5
MEMORY_BASE = 1.5 * GB

# Published configs (config.json of each release), minus token ids: those are the trained tokenizer's.
CONFIGS: dict[str, dict] = {
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, attention_bias=False, mlp_bias=False, hidden_act="silu",
        initializer_range=0.041666666666666664),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768, max_window_layers=24,
        use_sliding_window=False, hidden_act="silu", initializer_range=0.02),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
        mlp_bias=False, hidden_act="silu", initializer_range=0.02,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192}),
    "llama-3-8b-wide": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False, hidden_act="silu",
        initializer_range=0.02),
}
RELEASES = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M", "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
            "llama-3.2-1b": "meta-llama/Llama-3.2-1B", "llama-3-8b-wide": "meta-llama/Meta-Llama-3-8B (truncated)"}
WIDE = "llama-3-8b-wide"
# The sizes the memory model extrapolates to (published Llama-3 shapes).
EXTRAPOLATE = {
    "8B (Llama-3-8B)": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "70B (Llama-3-70B)": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                              tie_word_embeddings=False),
}
VARIANTS = {"default": [], "no-latency": ["--no-latency"],
            "export": ["--export", "onnx", "--no-latency"]}
# Memory-model constants: calibration as optkit reads it (calibration_batches x batch_size sequences of the
# input shape's length) and as the field usually calibrates (128 sequences of 2048 tokens).
CALIBRATIONS = {"optkit default": None, "128 × 2048": (128, 2048)}
OPTKIT_CALIB_SEQUENCES = 4 * 16
CUDA_CONTEXT_BYTES = 1 * GB
MACHINES = {"this host (24 GB RAM)": 24 * GB, "one 24 GB GPU": 24 * GB, "one 80 GB GPU": 80 * GB}
QUICK_MODEL = ("smollm2-135m", 2)


# ---------------------------------------------------------------- inputs: calibration text, tokenizer, models


def calibration_file(cache: Path) -> tuple[Path, dict]:
    """The calibration text (built once) and how it was cut."""
    files = sorted((p for p in (DOCS / CALIB_SUBDIR).rglob("*.rst.txt") if p.is_file()),
                   key=lambda p: p.relative_to(DOCS).as_posix())
    if not files:
        raise SystemExit(f"{DOCS} is missing: apt-get install python3.11-doc")
    chosen, total = [], 0
    for path in files:
        chosen.append(path)
        total += path.stat().st_size
        if total >= CALIB_BYTES:
            break
    text = "".join(p.read_text(encoding="utf-8") for p in chosen)
    path = cache / "calibration-python-docs.txt"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, text)
    return path, {"selection": f"the files under {DOCS}/{CALIB_SUBDIR}/ in path order, whole, until "
                               f"{CALIB_BYTES:,} bytes are reached", "files": len(chosen),
                  "first": chosen[0].relative_to(DOCS).as_posix(), "last": chosen[-1].relative_to(DOCS).as_posix(),
                  "bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def model_name(model: str, blocks: int | None) -> str:
    return f"{model}-{blocks}blk" if blocks else model


def build_worker(model: str, blocks: int | None, cache: Path) -> None:
    """(In a process of its own) train the tokenizer once and save the model's bf16 folder with it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer_file = cache / "tokenizer" / "tokenizer.json"
    if not tokenizer_file.is_file():
        files = sorted(p for p in DOCS.rglob("*.rst.txt") if p.is_file())
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=2, special_tokens=[END_OF_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator((p.read_text(encoding="utf-8") for p in files), trainer)
        tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(tokenizer_file.with_suffix(".tmp")))
        os.replace(tokenizer_file.with_suffix(".tmp"), tokenizer_file)
    fields = dict(CONFIGS[model])
    if blocks:
        fields["num_hidden_layers"] = blocks
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer_file)), bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT, model_max_length=fields["max_position_embeddings"])
    eot = wrapped.convert_tokens_to_ids(END_OF_TEXT)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=eot,
                                               eos_token_id=eot, pad_token_id=eot)
    torch.manual_seed(SEED)
    built = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    folder = cache / "models" / model_name(model, blocks)
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    built.save_pretrained(str(staging))
    wrapped.save_pretrained(str(staging))
    (staging / "llm-scale.json").write_text(json.dumps(_build_key(model, blocks)) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)


def _build_key(model: str, blocks: int | None) -> dict:
    return {"config": CONFIGS[model], "blocks": blocks, "seed": SEED, "tokenizer_vocab": TOKENIZER_VOCAB,
            "dtype": "bfloat16"}


def model_folder(model: str, blocks: int | None, cache: Path) -> tuple[Path, float | None]:
    """The model's folder, built unless the cache holds one built from the same settings (and the build seconds)."""
    folder = cache / "models" / model_name(model, blocks)
    marker = folder / "llm-scale.json"
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(_build_key(model, blocks))):
        return folder, None
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--_build", model, "--_blocks", str(blocks or 0), "--cache", str(cache)],
                   check=True)
    return folder, round(time.perf_counter() - start, 1)


# ---------------------------------------------------------------- reading checkpoints (safetensors headers only)


def safetensors_summary(folder: Path) -> dict:
    """Parameters (sum of numel of the stored tensors: a tied head is stored once), dtypes and bytes of a folder's
    safetensors files, read from their headers; a block's and the embeddings' parameters too."""
    params, dtypes, size, block, embed = 0, set(), 0, 0, 0
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        size += path.stat().st_size
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(entry["shape"])
            params += numel
            dtypes.add(entry["dtype"])
            if ".layers.0." in f".{name}":
                block += numel
            if "embed_tokens" in name:
                embed += numel
    return {"params": params, "dtypes": sorted(dtypes), "safetensors_bytes": size,
            "safetensors_files": [p.name for p in files], "block_params": block, "embed_params": embed}


def shape_params(hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                 num_key_value_heads: int, vocab_size: int, tie_word_embeddings: bool, head_dim: int | None = None,
                 **_) -> dict:
    """Parameters of a Llama-shaped model from its config (no biases): one block, embeddings, total."""
    head_dim = head_dim or hidden_size // num_attention_heads
    attention = hidden_size * head_dim * (2 * num_attention_heads + 2 * num_key_value_heads)
    block = attention + 3 * hidden_size * intermediate_size + 2 * hidden_size
    embed = vocab_size * hidden_size
    total = num_hidden_layers * block + embed * (1 if tie_word_embeddings else 2) + hidden_size
    return {"block": block, "embed": embed, "total": total, "hidden": hidden_size,
            "intermediate": intermediate_size, "blocks": num_hidden_layers}


# ---------------------------------------------------------------- measuring one optkit run


def measure_worker(spec_path: Path) -> None:
    """(In a process of its own, so RUSAGE_CHILDREN holds this run alone) run the command, poll its tree's RSS,
    stamp its output lines; print one JSON line."""
    import resource

    import psutil

    spec = json.loads(spec_path.read_text())
    log = open(spec["log"], "w", encoding="utf-8")
    start = time.perf_counter()
    proc = subprocess.Popen(spec["argv"], cwd=spec["cwd"], env={**os.environ, **spec["env"]},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    lines: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def pump(stream, tag: str) -> None:
        for line in stream:
            t = time.perf_counter() - start
            with lock:
                lines.append((t, tag, line.rstrip("\n")))
                log.write(f"{t:9.2f} {tag} {line}")
                log.flush()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
    for thread in pumps:
        thread.start()
    root = psutil.Process(proc.pid)
    samples: list[tuple[float, int, int]] = []
    min_available = psutil.virtual_memory().available
    while proc.poll() is None:
        tree, main = 0, 0
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            members = []
        for member in members:
            try:
                rss = member.memory_info().rss
            except psutil.Error:
                continue
            tree += rss
            main = rss if member is root else main
        samples.append((round(time.perf_counter() - start, 2), tree, main))
        min_available = min(min_available, psutil.virtual_memory().available)
        time.sleep(POLL_S)
    wall = time.perf_counter() - start
    for thread in pumps:
        thread.join(timeout=10)
    log.close()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"returncode": proc.returncode, "wall_s": round(wall, 2),
                      "ru_maxrss_children_bytes": usage.ru_maxrss * 1024, "cpu_user_s": round(usage.ru_utime, 1),
                      "cpu_sys_s": round(usage.ru_stime, 1), "min_available_bytes": min_available,
                      "samples": samples, "lines": lines}))


def run_measured(argv: list[str], cwd: Path, env: dict, log: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"argv": argv, "cwd": str(cwd), "env": env, "log": str(log)}, f)
    try:
        done = subprocess.run([sys.executable, __file__, "--_measure", f.name], capture_output=True, text=True,
                              check=True)
    finally:
        os.unlink(f.name)
    return json.loads(done.stdout.strip().splitlines()[-1])


def stages(measured: dict, report: dict | None) -> list[dict]:
    """Stages with seconds and the peak tree RSS sampled while each ran: loading (and the probes before the
    passes), each pass (from the line optkit prints as it starts it), and what follows the last pass (the
    after-probe and the writes); a pass's seconds are report.json's where it has them."""
    marks = [(t, line.split("running", 1)[1].strip()) for t, _, line in measured["lines"]
             if line.lstrip().startswith("[") and "] running " in line]
    passes = {p["name"]: p for p in (report or {}).get("passes", [])}
    wall, samples = measured["wall_s"], measured["samples"]
    bounds = [(0.0, "load + probes")]
    for index, (t, name) in enumerate(marks):
        bounds.append((t, name))
        end_of_pass = t + passes[name]["seconds"] if name in passes else None
        if index == len(marks) - 1 and end_of_pass is not None and end_of_pass < wall:
            bounds.append((end_of_pass, "after passes (probe, writes)"))
    out = []
    for index, (begin, name) in enumerate(bounds):
        end = bounds[index + 1][0] if index + 1 < len(bounds) else wall
        inside = [tree for t, tree, _ in samples if begin <= t <= end]
        row = {"stage": name, "seconds": round(end - begin, 1), "peak_rss_bytes": max(inside, default=None)}
        if name in passes:
            row["report_seconds"] = passes[name]["seconds"]
            row.update({k: v for k, v in passes[name].items() if any(s in k for s in ("rss", "memory", "peak"))})
        out.append(row)
    return out


def first_error(lines: list) -> str | None:
    texts = [line for _, _, line in lines if line.strip()]
    for line in texts:
        if line.startswith("Error:"):
            return line.strip()
    tracebacks = [line for line in texts if not line.startswith(" ") and ("Error" in line or "Exception" in line)]
    if tracebacks:
        return tracebacks[-1].strip()
    return texts[-1].strip() if texts else None


def run_error(measured: dict) -> str:
    """What ended a failed run: the signal that killed it (nothing optkit prints says so), or its first error."""
    code = measured["returncode"]
    if code < 0:
        last = next((line.strip() for _, _, line in reversed(measured["lines"]) if line.strip()), "nothing")
        return f"killed by {signal.Signals(-code).name} from outside the run (its last line: {last})"
    return first_error(measured["lines"]) or f"exit code {code}"


def settled_load(below: float = 1.0, patience_s: float = 90.0) -> float:
    """The 1-minute load average, after waiting (up to ``patience_s``) for it to drop below ``below``."""
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


def key_notes(notes: list[str]) -> list[str]:
    """The notes on the target reached, then the first few others."""
    reached = [note for note in notes if "achieved" in note]
    return reached + [note for note in notes if note not in reached][:NOTES_KEPT]


def wait_for_memory(needed: float, patience_s: float) -> int:
    """Available memory (bytes), after waiting up to ``patience_s`` for ``needed`` to be free: the host is shared,
    and a run that the kernel kills for memory measures nothing (and may take another's job with it)."""
    import psutil

    deadline = time.monotonic() + patience_s
    while psutil.virtual_memory().available < needed and time.monotonic() < deadline:
        time.sleep(10)
    available = psutil.virtual_memory().available
    if available < needed:
        print(f"note: {available / GB:.1f} GB available, {needed / GB:.1f} GB wanted; running anyway", flush=True)
    return available


def measure(model: str, blocks: int | None, variant: str, args, folder: Path, calib: Path) -> dict:
    out = args.runs / args.label / f"{model_name(model, blocks)}-{variant}"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "optkit", "optimize", str(folder), "--target-params", f"{TARGET_PARAMS:g}",
            "--calib-data", f"text:{calib}", "--out", str(out), "--force", *VARIANTS[variant]]
    shown = ["optkit", "optimize", "DIR", "--target-params", f"{TARGET_PARAMS:g}", "--calib-data", "text:FILE",
             "--out", "OUT", "--force", *VARIANTS[variant]]
    source = safetensors_summary(folder)
    available = wait_for_memory(MEMORY_PER_CHECKPOINT_BYTE * source["safetensors_bytes"] + MEMORY_BASE,
                                args.memory_patience)
    load = settled_load()
    print(f"[{args.label}] {model_name(model, blocks)} {variant}: load {load}; $ {' '.join(argv)}", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    measured = run_measured(argv, args.optkit_root, {"PYTHONPATH": str(args.optkit_root)},
                            out.parent / f"{out.name}.log")
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if measured["returncode"] == 0 and report_path.is_file() else None
    peak = max((tree for _, tree, _ in measured["samples"]), default=0)
    peak_at = next((t for t, tree, _ in measured["samples"] if tree == peak), None)
    row = {"label": args.label, "model": model_name(model, blocks), "family": model, "blocks": blocks or
           CONFIGS[model]["num_hidden_layers"], "truncated": bool(blocks), "variant": variant,
           "command": " ".join(shown), "argv": argv, "started": started, "load_avg_1min_before": load,
           "available_before_bytes": available,
           "returncode": measured["returncode"], "wall_s": measured["wall_s"], "peak_rss_tree_bytes": peak,
           "peak_rss_main_bytes": max((m for _, _, m in measured["samples"]), default=0), "peak_at_s": peak_at,
           "ru_maxrss_children_bytes": measured["ru_maxrss_children_bytes"], "cpu_user_s": measured["cpu_user_s"],
           "cpu_sys_s": measured["cpu_sys_s"], "min_available_bytes": measured["min_available_bytes"],
           "input": source, "stages": stages(measured, report), "rss_series": _downsample(measured["samples"])}
    if measured["returncode"] != 0 or report is None:
        row["error"] = run_error(measured)
        row["log_tail"] = [line for _, _, line in measured["lines"][-15:]]
    else:
        written = safetensors_summary(out)
        row["output"] = {**written, "files": {p.relative_to(out).as_posix(): p.stat().st_size
                                              for p in sorted(out.rglob("*")) if p.is_file()}}
        row["params_fraction"] = round(written["params"] / source["params"], 4) if written["params"] else None
        row["report"] = {"params_ratio": (report.get("ratios") or {}).get("params"), "notes": len(report["notes"]),
                         "first_notes": key_notes(report["notes"]),
                         "input_shape": report.get("input_shape"),
                         "passes": [{"name": p["name"], "seconds": p["seconds"]} for p in report["passes"]]}
    if not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({k: v for k, v in row.items() if k not in ("rss_series", "argv", "input", "output")}),
          flush=True)
    return row


def _downsample(samples: list, points: int = 240) -> list[list[float]]:
    """[seconds, tree RSS GB] at most ``points`` of them, each bucket's maximum (so the peak survives)."""
    if not samples:
        return []
    step = max(1, math.ceil(len(samples) / points))
    return [[samples[i][0], round(max(s[1] for s in samples[i:i + step]) / GB, 3)]
            for i in range(0, len(samples), step)]


# ---------------------------------------------------------------- the run's surroundings


def environment(optkit_root: Path) -> dict:
    """Machine, versions, which optkit the runs import, and the RSS of a process that has only imported it."""
    code = ("import resource, sys, torch, transformers, optkit, optkit.cli; "
            "print(optkit.__file__, torch.__version__, transformers.__version__, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    done = subprocess.run([sys.executable, "-c", code], cwd=optkit_root, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(optkit_root)})
    optkit_file, torch_version, transformers_version, baseline = done.stdout.split()
    git = lambda *a: subprocess.run(["git", "-C", str(optkit_root), *a], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"optkit_root": str(optkit_root), "optkit_imported": optkit_file, "optkit_commit": git("rev-parse", "HEAD"),
            "optkit_dirty": bool(git("status", "--porcelain", "--", "optkit")),
            "baseline_rss_bytes": int(baseline), "torch": torch_version, "transformers": transformers_version,
            "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} logical CPUs, {total / GB:.1f} GB RAM",
            "date": datetime.date.today().isoformat()}


# ---------------------------------------------------------------- the memory model


def activation_bytes(shape: dict, sequences: int, length: int) -> float:
    """Calibration activations in fp32: every sequence's block input and output (hidden wide), plus one batch of
    16 sequences' MLP intermediates (gate, up, product)."""
    return 4 * (2 * sequences * length * shape["hidden"] + 3 * min(16, sequences) * length * shape["intermediate"])


def block_by_block(shape: dict, overhead: float, sequences: int, length: int) -> dict:
    """Predicted peaks under block-by-block processing (see the Markdown for the formula)."""
    resident = 2 * shape["total"]
    block_fp32 = 4 * shape["block"]
    acts = activation_bytes(shape, sequences, length)
    return {"host_resident": overhead + resident + block_fp32 + acts,
            "host_mmap": overhead + 2 * shape["block"] + block_fp32 + acts + 2 * shape["embed"],
            "device": CUDA_CONTEXT_BYTES + block_fp32 + acts, "host_with_gpu": overhead + resident}


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope), or None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def memory_model(record: dict) -> dict:
    """Per label: the linear fit of peak RSS on checkpoint bytes, the block multiplier measured on the 8B-wide
    rows, and the extrapolations to 8 B and 70 B."""
    out = {}
    for label in labels(record):
        rows = [r for r in record["rows"] if r["label"] == label and r["variant"] == "default" and "error" not in r]
        if not rows:
            continue
        overhead = record["labels"][label]["baseline_rss_bytes"]
        fit = linear_fit([(r["input"]["safetensors_bytes"], r["peak_rss_tree_bytes"]) for r in rows])
        wide = sorted((r for r in rows if r["family"] == WIDE), key=lambda r: r["blocks"])
        per_block = linear_fit([(r["blocks"], r["peak_rss_tree_bytes"]) for r in wide])
        multipliers = {}
        for r in rows:
            shape = shape_params(**{**CONFIGS[r["family"]], "num_hidden_layers": r["blocks"]})
            length = (r.get("report") or {}).get("input_shape", [1, 128])[-1]
            rest = (r["peak_rss_tree_bytes"] - overhead - r["input"]["safetensors_bytes"]
                    - activation_bytes(shape, OPTKIT_CALIB_SEQUENCES, length))
            multipliers[r["model"]] = round(rest / (4 * shape["block"]), 2)
        extrapolated = {}
        for size, fields in EXTRAPOLATE.items():
            shape = shape_params(**fields)
            entry = {"params": shape["total"], "checkpoint_bytes": 2 * shape["total"]}
            if fit:
                entry["fit_host"] = fit[0] + fit[1] * 2 * shape["total"]
            if per_block and wide:
                base = wide[-1]
                scale = shape["block"] / shape_params(**CONFIGS[WIDE])["block"]
                entry["per_block_host"] = (base["peak_rss_tree_bytes"]
                                           + (shape["blocks"] - base["blocks"]) * per_block[1] * scale)
            if wide:
                k = multipliers[wide[-1]["model"]]
                entry["wide_multiplier"] = k
                entry["wide_multiplier_host"] = (overhead + 2 * shape["total"] + k * 4 * shape["block"]
                                                 + activation_bytes(shape, OPTKIT_CALIB_SEQUENCES, 128))
            entry["formula"] = {name: block_by_block(shape, overhead, *(calib or (OPTKIT_CALIB_SEQUENCES, 128)))
                                for name, calib in CALIBRATIONS.items()}
            extrapolated[size] = entry
        out[label] = {"fit": fit, "per_block_fit": per_block, "block_multipliers": multipliers,
                      "peak_per_checkpoint_byte": {r["model"]: round(r["peak_rss_tree_bytes"]
                                                                     / r["input"]["safetensors_bytes"], 2)
                                                   for r in rows},
                      "overhead_bytes": overhead, "extrapolated": extrapolated}
    return out


# ---------------------------------------------------------------- results: JSON, Markdown, PNG


def labels(record: dict) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in record["rows"]))


def _gb(value: float | None) -> str:
    return "–" if value is None else f"{value / GB:.2f}"


def _s(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f} s" if value < 90 else f"{int(value // 60)} min {value % 60:02.0f} s"


def _commands(info: dict) -> list[str]:
    """The commands that wrote a label's rows (a single ``command`` in results written before the list)."""
    return info.get("commands") or ([info["command"]] if "command" in info else [])


def _cpu_s(row: dict) -> float:
    return row["cpu_user_s"] + row["cpu_sys_s"]


def _kept(row: dict) -> str:
    return f"{row['params_fraction']:.3f}"


def _fits(value: float, limit: float) -> str:
    return f"{value / GB:.1f} ({'fits' if value <= limit else 'no'})"


def markdown(record: dict) -> str:
    order = {m: i for i, m in enumerate(CONFIGS)}
    shown_labels = labels(record)
    rows = sorted(record["rows"], key=lambda r: (order[r["family"]], r["blocks"], r["variant"],
                                                 shown_labels.index(r["label"])))
    lines = ["# `optkit optimize` on language models of released sizes: time and memory", "",
             "Random weights in the published configs' shapes, saved in bf16 (`save_pretrained`, safetensors) with a "
             f"BPE tokenizer ({TOKENIZER_VOCAB:,} tokens) trained on the Python 3.11 documentation; "
             f"`{record['command_pattern']}`, run as a subprocess from the `--optkit-root` checkout. "
             "Peak RSS: the process tree's RSS summed, polled every 0.1 s (`ru_maxrss`: the largest single "
             "process, from `getrusage(RUSAGE_CHILDREN)`). Params kept: parameters stored in the written "
             "safetensors over the input's (a tied head counted once), read from the files' headers here. "
             f"Calibration: `text:FILE` with {record['calibration']['selection']} "
             f"({record['calibration']['files']} files, `{record['calibration']['first']}` … "
             f"`{record['calibration']['last']}`, {record['calibration']['bytes']:,} bytes, sha256 "
             f"`{record['calibration']['sha256'][:16]}…`). Load average: the 1-minute figure just before each run "
             "(the machine is shared: with a load above its 2 cores, wall time stretches while CPU seconds, all of "
             "the run's threads and child processes, much less). Models: "
             + "; ".join(f"`{k}` = {v}" for k, v in RELEASES.items()) + ".", ""]
    for label in shown_labels:
        info = record["labels"][label]
        modified = " (modified)" if info["optkit_dirty"] else ""
        lines.append(f"- **{label}**: optkit {info['optkit_commit'][:10]}{modified}"
                     f" from `{info['optkit_root']}`; {info['machine']}; torch {info['torch']}, transformers "
                     f"{info['transformers']}; {info['date']}; a process that only imports torch, transformers and "
                     f"optkit peaks at {_gb(info['baseline_rss_bytes'])} GB. Commands: "
                     + ", ".join(f"`{c}`" for c in _commands(info)) + ".")
    lines += ["", "## Measured", "",
              "| model | params | checkpoint GB | variant | label | wall | CPU s (user+sys) | peak RSS GB (tree) | "
              "ru_maxrss GB | params kept | written dtype | written safetensors GB | load avg | "
              "GB available at start / least during | stages (s) |",
              "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        stage_text = ", ".join(f"{s['stage']} {s.get('report_seconds', s['seconds']):.0f}" for s in r["stages"])
        common = (f"| {r['model']} | {r['input']['params'] / 1e6:,.0f} M | {_gb(r['input']['safetensors_bytes'])} | "
                  f"{r['variant']} | {r['label']} | {_s(r['wall_s'])} | {r['cpu_user_s'] + r['cpu_sys_s']:.0f} | "
                  f"{_gb(r['peak_rss_tree_bytes'])} | "
                  f"{_gb(r['ru_maxrss_children_bytes'])} |")
        tail = (f"{r['load_avg_1min_before']:.2f} | {_gb(r.get('available_before_bytes'))} / "
                f"{_gb(r['min_available_bytes'])} | {stage_text} |")
        if "error" in r:
            lines.append(f"{common} failed: `{r['error'][:150]}` | – | – | {tail}")
        else:
            lines.append(f"{common} {r['params_fraction']:.3f} | {'/'.join(r['output']['dtypes'])} | "
                         f"{_gb(r['output']['safetensors_bytes'])} | {tail}")
    if len(shown_labels) >= 2:
        first, second = ("before", "after") if {"before", "after"} <= set(shown_labels) else (shown_labels[0],
                                                                                               shown_labels[-1])
        lines += ["", f"## {first} vs {second}", "",
                  f"× is {second} ÷ {first}.", "",
                  f"| model | variant | wall {first} | wall {second} | × | CPU s {first} | CPU s {second} | × | "
                  f"peak RSS GB {first} | peak RSS GB {second} | × | params kept {first} | params kept {second} |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        keyed = {(r["model"], r["variant"], r["label"]): r for r in rows}
        measures = [(lambda r: r["wall_s"], _s), (_cpu_s, lambda v: f"{v:.0f}"),
                    (lambda r: r["peak_rss_tree_bytes"], _gb)]
        for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in rows):
            pair = [keyed.get((model, variant, label)) for label in (first, second)]
            ok = [r is not None and "error" not in r for r in pair]
            cells = []
            for value, fmt in measures:
                cells += [fmt(value(r)) if good else "–" for r, good in zip(pair, ok)]
                cells.append(f"{value(pair[1]) / value(pair[0]):.2f}" if all(ok) else "–")
            cells += [_kept(r) if good else "–" for r, good in zip(pair, ok)]
            lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    lines += ["", "## Stages", "",
              "Seconds per stage (report.json's for passes; the rest from the times optkit printed its stage lines) "
              "and the peak tree RSS sampled while each ran.", "",
              "| model | variant | label | stage | seconds | peak RSS GB |", "|---|---|---|---|---:|---:|"]
    for r in rows:
        for s in r["stages"]:
            lines.append(f"| {r['model']} | {r['variant']} | {r['label']} | {s['stage']} | "
                         f"{s.get('report_seconds', s['seconds']):.1f} | {_gb(s['peak_rss_bytes'])} |")
    lines += ["", "## Files written", "", "| model | variant | label | files (bytes) |", "|---|---|---|---|"]
    for r in rows:
        if "output" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['label']} | "
                         + ", ".join(f"{k} {v:,}" for k, v in r["output"]["files"].items()) + " |")
    noted = [r for r in rows if (r.get("report") or {}).get("first_notes")]
    if noted:
        lines += ["", "## Notes optkit gave", "", f"Each run's notes on the target it reached, then its first "
                  f"{NOTES_KEPT} others (all are in its report.json; their number in brackets).", ""]
        for r in noted:
            lines.append(f"- {r['label']} {r['model']} ({r['variant']}, {r['report']['notes']} notes): "
                         + "; ".join(f"“{note}”" for note in r["report"]["first_notes"]))
    failures = [r for r in rows if "error" in r] + record.get("earlier_failures", [])
    if failures:
        lines += ["", "## Failures", "", "Runs that did not finish, including earlier attempts a later run replaced "
                  "(started at; 1-minute load average before; peak tree RSS and least memory available while it "
                  "ran).", ""]
        lines += [f"- {r['label']} {r['model']} ({r['variant']}), started {r['started']}, load "
                  f"{r['load_avg_1min_before']:.2f}: exit {r['returncode']} after {_s(r['wall_s'])}, peak "
                  f"{_gb(r['peak_rss_tree_bytes'])} GB, least available {_gb(r['min_available_bytes'])} GB: "
                  f"`{r['error']}`" for r in failures]
    lines += memory_markdown(record)
    return "\n".join(lines) + "\n"


def memory_markdown(record: dict) -> list[str]:
    model = record.get("memory_model") or {}
    lines = ["", "## Memory model: 8 B and 70 B", "",
             "Measured rows above; everything in this section is **extrapolated**. Under block-by-block processing "
             "(SparseGPT, Wanda, FLAP and SliceGPT's loop), with P the parameters, P_b one block's, P_e the "
             "embedding matrix's, h the hidden width, m the MLP width, N × L the calibration tokens and O the "
             "process that has imported torch, transformers and optkit:", "",
             "- host, weights resident: **peak = O + 2·P (bf16 model) + 4·P_b (one block in fp32) + A**",
             "- host, weights memory-mapped (pages are file-backed and reclaimable): "
             "**peak = O + 2·P_e (embeddings, for the first block's inputs) + 2·P_b + 4·P_b + A**",
             f"- GPU: **device peak = C + 4·P_b + A** (C = {CUDA_CONTEXT_BYTES / GB:.0f} GB CUDA context and "
             "workspace), host = O + 2·P resident (or memory-mapped)",
             "- A = 4·(2·N·L·h + 3·16·L·m): fp32 block inputs and outputs of every calibration sequence, "
             "plus one batch of 16 sequences' MLP intermediates.", "",
             f"optkit's default calibration reads {OPTKIT_CALIB_SEQUENCES} sequences (4 batches × 16) of the input "
             "length (128 tokens here); the field usually calibrates on 128 × 2048 tokens. Two fits of the "
             "measurements show where the current code sits: the least-squares line of peak RSS on checkpoint "
             "bytes, and the block multiplier k = (peak − O − checkpoint bytes − A) / (4·P_b) of each row (1 "
             "under block-by-block processing; the largest block, the truncated 8B-wide model, gives the "
             "multiplier used for 8 B and 70 B). Limits: 24 GB for this host and the 24 GB GPU, 80 GB for the "
             "80 GB GPU; others' use of this shared host is not subtracted.", ""]
    for label, entry in model.items():
        fit, per_block = entry["fit"], entry["per_block_fit"]
        fit_text = (f"peak ≈ {fit[0] / GB:.2f} GB + {fit[1]:.2f} × checkpoint bytes" if fit
                    else "fewer than two checkpoint sizes measured: no line")
        block_text = (f"; per 8B-wide block {per_block[1] / GB:.2f} GB" if per_block else "")
        lines += [f"### {label}", "", f"Fit: {fit_text}{block_text}; peak ÷ checkpoint bytes per row: "
                  + ", ".join(f"{m} {ratio:.1f}" for m, ratio in entry["peak_per_checkpoint_byte"].items())
                  + "; block multiplier k per row: "
                  + ", ".join(f"{m} {k:g}" for m, k in entry["block_multipliers"].items())
                  + f"; O = {entry['overhead_bytes'] / GB:.2f} GB.", "",
                  "| size | params | checkpoint GB (bf16) | how | calibration | host peak GB (24 GB host) | "
                  "one 24 GB GPU: device GB | one 80 GB GPU: device GB |", "|---|---:|---:|---|---|---:|---:|---:|"]
        for size, e in entry["extrapolated"].items():
            head = f"| {size} | {e['params'] / 1e9:.2f} B | {e['checkpoint_bytes'] / GB:.1f} |"
            if "fit_host" in e:
                lines.append(f"{head} current code, line on checkpoint bytes (extrapolated) | optkit default | "
                             f"{_fits(e['fit_host'], 24 * GB)} | – | – |")
            if "per_block_host" in e:
                lines.append(f"{head} current code, 8B-wide per-block line (extrapolated) | optkit default | "
                             f"{_fits(e['per_block_host'], 24 * GB)} | – | – |")
            if "wide_multiplier_host" in e:
                lines.append(f"{head} block-by-block with the measured k = {e['wide_multiplier']:g} (extrapolated) | "
                             f"optkit default | {_fits(e['wide_multiplier_host'], 24 * GB)} | – | – |")
            for calib, f in e["formula"].items():
                lines.append(f"{head} block-by-block formula, weights resident (extrapolated) | {calib} | "
                             f"{_fits(f['host_resident'], 24 * GB)} | {_fits(f['device'], 24 * GB)} | "
                             f"{_fits(f['device'], 80 * GB)} |")
                lines.append(f"{head} block-by-block formula, weights memory-mapped (extrapolated) | {calib} | "
                             f"{_fits(f['host_mmap'], 24 * GB)} | {_fits(f['device'], 24 * GB)} | "
                             f"{_fits(f['device'], 80 * GB)} |")
        lines.append("")
    return lines


def plot(record: dict, path: Path) -> None:
    """Wall time (and CPU time) and peak RSS against parameters, one colour per label (squares: truncated models,
    x: failed runs); the line of peak RSS on checkpoint bytes extended to 8 B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    figure, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x = lambda r: r["input"]["params"] / 1e9
    series = ((left, lambda r: r["wall_s"] / 60, "o", "-", "wall"), (left, lambda r: _cpu_s(r) / 60, "^", "--", "CPU"),
              (right, lambda r: r["peak_rss_tree_bytes"] / GB, "o", "-", None))
    for index, label in enumerate(labels(record)):
        color = colors[index % len(colors)]
        for variant in VARIANTS:
            rows = sorted((r for r in record["rows"] if r["label"] == label and r["variant"] == variant
                           and "error" not in r), key=x)
            full = [r for r in rows if not r["truncated"]]
            name = label if variant == "default" else f"{label}, {variant}"
            for axis, y, marker, style, what in series:
                style = style if variant == "default" else ":"
                if full:
                    axis.plot([x(r) for r in full], [y(r) for r in full], marker + style, color=color,
                              mfc=color if variant == "default" else "none",
                              label=f"{name}{', ' + what + ' time' if what else ''}")
                for r in rows:
                    if r["truncated"]:
                        axis.plot(x(r), y(r), "s", mfc="none", color=color)
                        axis.annotate(f"{r['family']}, {r['blocks']} blocks", (x(r), y(r)), fontsize=6,
                                      xytext=(4, 4), textcoords="offset points")
        for r in record["rows"]:
            if r["label"] == label and "error" in r:
                for axis, y, *_ in series:
                    axis.plot(x(r), y(r), "x", color=color)
        fit = (record.get("memory_model") or {}).get(label, {}).get("fit")
        if fit:
            low = min(x(r) for r in record["rows"] if r["label"] == label)
            xs = [low * (8.03 / low) ** (i / 40) for i in range(41)]
            right.plot(xs, [(fit[0] + fit[1] * 2e9 * v) / GB for v in xs], "--", color=color, lw=0.8,
                       label=f"{label}: line on checkpoint bytes, to 8 B (extrapolated)")
    right.axhline(24, color="grey", lw=0.8, ls="--")
    right.annotate("24 GB (this host)", (0.02, 24), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    left.set(xlabel="parameters (billions)", ylabel="minutes", title="optkit optimize --target-params 0.8: time")
    right.set(xlabel="parameters (billions)", ylabel="peak RSS of the process tree (GB)", title="Peak memory")
    for axis in (left, right):
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(FixedLocator([0.01, 0.03, 0.1, 0.3, 1, 3, 10]))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.suptitle("random-weight bf16 checkpoints in released shapes, on a shared 2-core host (load averages in "
                    "llm-scale.md)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _write_atomic(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8", suffix=".tmp") as f:
        f.write(text)
    os.replace(f.name, path)


def save(record: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    record["memory_model"] = memory_model(record)
    _write_atomic(results / f"{NAME}.json", json.dumps(record, indent=1) + "\n")
    _write_atomic(results / f"{NAME}.md", markdown(record))
    plot(record, results / f"{NAME}.png")


# ---------------------------------------------------------------- command line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Models: " + ", ".join(CONFIGS) + ". Variants: " + ", ".join(
                                         f"{k} ({' '.join(v) or 'default flags'})" for k, v in VARIANTS.items()))
    parser.add_argument("--label", default="after", help="name of this code version's rows (e.g. before, after); "
                        "rows with the same label, model and variant are replaced")
    parser.add_argument("--models", type=lambda v: v.split(","), default=list(CONFIGS),
                        help="comma-separated subset of the models (default: all)")
    parser.add_argument("--wide-blocks", type=lambda v: [int(x) for x in v.split(",")], default=[2],
                        help="blocks the 8B-wide model is truncated to, 2..4, comma-separated (default: 2)")
    parser.add_argument("--variants", type=lambda v: v.split(","), default=["default"],
                        help="comma-separated: default (the user's command), no-latency (adds --no-latency) and/or export "
                        "(adds --export onnx --no-latency: the ONNX export and its check)")
    parser.add_argument("--optkit-root", type=Path, default=ROOT,
                        help="checkout whose optkit the runs import (PYTHONPATH and working directory; "
                             "default: this repository)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "optkit-llm-scale",
                        help="folder for the built models, tokenizer and calibration text (reused between runs)")
    parser.add_argument("--runs", type=Path, default=None, help="folder for optkit's outputs and logs "
                        "(default: CACHE/runs; outputs are deleted once measured unless --keep-outputs)")
    parser.add_argument("--memory-patience", type=float, default=1800,
                        help="seconds to wait before a run for about 5 x its checkpoint bytes + 1.5 GB to be "
                             "available (the host is shared); then it runs anyway (default: 1800)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep each run's output folder")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where llm-scale.{json,md,png} go")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: SmolLM2-135M truncated to 2 blocks, label 'quick', results in a new "
                             "temporary folder (never the committed files)")
    parser.add_argument("--render", action="store_true",
                        help="rewrite the Markdown and PNG (and the memory model) from the JSON in --results; "
                             "run nothing")
    parser.add_argument("--_measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_build", help=argparse.SUPPRESS)
    parser.add_argument("--_blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        return measure_worker(args._measure)
    if args._build:
        return build_worker(args._build, args._blocks or None, args.cache)
    unknown = [m for m in args.models if m not in CONFIGS] + [v for v in args.variants if v not in VARIANTS]
    if unknown or not all(2 <= b <= 4 for b in args.wide_blocks):
        parser.error(f"unknown models/variants {unknown} or --wide-blocks outside 2..4; models: {', '.join(CONFIGS)}; "
                     f"variants: {', '.join(VARIANTS)}")
    args.optkit_root = args.optkit_root.resolve()
    args.runs = (args.runs or args.cache / "runs").resolve()
    jobs = [(m, b) for m in args.models for b in (args.wide_blocks if m == WIDE else [None])]
    if args.quick:
        args.label, jobs = "quick", [QUICK_MODEL]
        args.results = Path(tempfile.mkdtemp(prefix="llm-scale-quick-"))
    path = args.results / f"{NAME}.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": [], "labels": {}}
    if args.render:
        if not record["rows"]:
            parser.error(f"{path} holds no rows to render")
        save(record, args.results)
        print(f"wrote {args.results / NAME}.{{json,md,png}}", flush=True)
        return
    calib, record["calibration"] = calibration_file(args.cache)
    record["command_pattern"] = (f"optkit optimize DIR --target-params {TARGET_PARAMS:g} --calib-data text:FILE "
                                 "--out OUT --force")
    command = "python benchmarks/llm_scale.py " + " ".join(sys.argv[1:])
    earlier = _commands(record["labels"].get(args.label, {}))
    record["labels"][args.label] = {**environment(args.optkit_root),
                                    "commands": [*(c for c in earlier if c != command), command]}
    print(json.dumps(record["labels"][args.label]), flush=True)
    for model, blocks in jobs:
        folder, build_s = model_folder(model, blocks, args.cache)
        for variant in args.variants:
            row = measure(model, blocks, variant, args, folder, calib)
            row["driver_command"] = command
            if build_s is not None:
                row["build_s"] = build_s
            key = (row["label"], row["model"], row["variant"])
            replaced = [r for r in record["rows"] if (r["label"], r["model"], r["variant"]) == key]
            # A failed attempt that a new run replaces stays on record, without its samples.
            record.setdefault("earlier_failures", []).extend(
                {k: v for k, v in r.items() if k not in ("rss_series", "stages")} for r in replaced if "error" in r)
            record["rows"] = [r for r in record["rows"] if (r["label"], r["model"], r["variant"]) != key] + [row]
            save(record, args.results)
    print(f"wrote {args.results / NAME}.{{json,md,png}}", flush=True)


if __name__ == "__main__":
    main()
