"""``optkit optimize`` on Hugging Face ``save_pretrained`` folders (issue #29's development set), and torch-pruning's
own LLM recipe called directly on the same models, side by side.

For each model type (tiny config from ``benchmarks/_hf_configs.py``, random weights):

1. the model is built and written with ``save_pretrained``;
2. ``python -m optkit optimize DIR --prune 0.3 --export onnx --no-latency --save-pt --seq-len 32 --out OUT`` runs as a
   subprocess (``--input-shape 1,3,32,32`` for the image models);
3. apart from optkit: the stock ``AutoModelFor…`` class loads OUT with no missing or unexpected keys, its
   logits equal those of ``optkit.load_model(OUT/model.pt)``, parameters and MACs (sequence 128) are compared
   with the original, heads / KV heads / intermediate / layers are read from both configs, ``OUT/model.onnx``
   runs in ONNX Runtime on fresh inputs and matches, and decoders ``generate`` 8 tokens;
4. torch-pruning's LLM recipe (its ``examples/LLMs/prune_llm.py``: uniform L2 magnitude, ``num_heads`` per
   projection, ``prune_num_heads=True``, ``prune_head_dims=False``, ``round_to=4``, the output head ignored,
   then the config fields its example updates) runs on a fresh copy, and the result is written with
   ``save_pretrained`` and reloaded with ``from_pretrained``.

Usage (no timing is compared):

    python benchmarks/hf_zoo.py
    python benchmarks/hf_zoo.py --types vit swin   # rerun some, keep the others' rows

Writes benchmarks/results/hf-zoo.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _hf_configs import AUTO_CLASS, DEV_SET, IMAGE_SIZE, VOCAB, build, is_decoder, is_image, shape_of  # noqa: E402
from _results import pin_lines  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
RATIO = 0.3
SEQ_LEN = 32
MACS_SEQ_LEN = 128
TIME_LIMIT_S = 600.0
# torch-pruning's recipe takes a second or two on these models when it finishes at all.
TP_TIME_LIMIT_S = 20
LOGITS_ATOL = 1e-5
ONNX_RTOL = 1e-4
# One decoder and one encoder also run with --drop-blocks 1.
DEPTH_RUNS = ("llama", "bert")
TP_HEAD_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q_lin", "k_lin", "v_lin"))
TP_FUSED_NAMES = ("qkv_proj", "query_key_value", "c_attn")


def cli_input(model_type: str) -> list[str]:
    """The CLI's input option for a type: token ids of length 32, or a 32×32 RGB image."""
    if is_image(model_type):
        return ["--input-shape", f"1,3,{IMAGE_SIZE},{IMAGE_SIZE}"]
    return ["--seq-len", str(SEQ_LEN)]


def example(model_type: str, batch: int = 2, seed: int = 1) -> dict:
    """Fresh inputs for a forward pass: ``input_ids`` + ``attention_mask``, or ``pixel_values``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if is_image(model_type):
        return {"pixel_values": torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)}
    ids = torch.randint(3, VOCAB, (batch, SEQ_LEN), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def first_error_line(text: str) -> str:
    """The CLI's one-line ``Error: ...``, else the last line of its output."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    return ((errors or lines or ["(no output)"])[0 if errors else -1])[:300]


def run_optkit(model_type: str, work: Path, drop_blocks: int, time_limit: float) -> dict:
    """Write the tiny model's folder, run the CLI on it and check OUT apart from optkit."""
    original = build(model_type)
    source = work / "in"
    original.save_pretrained(source)
    out = work / "out"
    command = [sys.executable, "-m", "optkit", "optimize", str(source), "--prune", str(RATIO), "--export", "onnx",
               "--no-latency", "--save-pt", *cli_input(model_type), "--out", str(out)]
    if drop_blocks:
        command += ["--drop-blocks", str(drop_blocks)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=time_limit, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no exit within {time_limit:g} s"}
    row = {"exit_code": proc.returncode, "cli_seconds": round(time.perf_counter() - start, 1),
           "before": shape_of(original.config)}
    if proc.returncode != 0:
        return {**row, "status": "error", "error": first_error_line(proc.stderr + "\n" + proc.stdout)}
    report = json.loads((out / "report.json").read_text())
    transformer = next((p["details"].get("transformer") for p in report["passes"]
                        if "transformer" in p.get("details", {})), None) or {}
    row["skipped"] = transformer.get("skipped", [])
    row["folder_notes"] = [n for n in report["notes"] if "save_pretrained files" in n]
    row.update(check_outputs(model_type, original, out))
    acceptance = ["reload_ok", "logits_equal", "params_ok", "width_ok", "onnx_ok"]
    acceptance += ["generate_ok"] if is_decoder(model_type) else []
    row["status"] = "ok" if all(row.get(key) for key in acceptance) else "check failed"
    return row


def check_outputs(model_type: str, original, out: Path) -> dict:
    """Stock-class reload, logits, sizes, MACs, ONNX parity and generation of what the CLI wrote."""
    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    from optkit import load_model
    from optkit.model.stats import count_macs

    checks: dict = {}
    inputs = example(model_type)
    pruned = load_model(out / "model.pt").eval()
    with torch.no_grad():
        expected = pruned(**inputs).logits
    try:
        stock, info = getattr(transformers, AUTO_CLASS[model_type]).from_pretrained(out, output_loading_info=True)
        stock.eval()
        wrong = {k: len(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        checks["reload_class"] = type(stock).__name__
        checks["reload_ok"] = type(stock) is type(original) and not wrong
        if wrong:
            checks["reload_error"] = f"keys: {wrong}"
        with torch.no_grad():
            checks["logits_max_diff"] = float((stock(**inputs).logits - expected).abs().max())
        checks["logits_equal"] = checks["logits_max_diff"] <= LOGITS_ATOL
        checks["after"] = shape_of(stock.config)
    except Exception as e:  # the failure is the measurement
        checks.update(reload_ok=False, reload_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        checks["after"] = shape_of(pruned.config)
    before, after = shape_of(original.config), checks["after"]
    params = sum(p.numel() for p in pruned.parameters()) / sum(p.numel() for p in original.parameters())
    checks["params_ratio"] = round(params, 4)
    checks["params_ok"] = params <= 0.8
    # Fewer heads and a narrower MLP, each where the type has them (gpt2's class cannot hold fewer heads).
    checks["heads_reduced"] = str(after["heads"]) != str(before["heads"])
    checks["mlp_reduced"] = after["intermediate"] != before["intermediate"]
    checks["width_ok"] = checks["heads_reduced"] and checks["mlp_reduced"]
    shape = (1, 3, IMAGE_SIZE, IMAGE_SIZE) if is_image(model_type) else (1, MACS_SEQ_LEN)
    checks["macs_ratio"] = round(count_macs(pruned, shape) / count_macs(original, shape), 4)
    try:
        session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        # An image model's one input is named "input" in the ONNX file, pixel_values in the Hugging Face call.
        feeds = ({names[0]: next(iter(inputs.values())).numpy()} if len(names) == 1 and len(inputs) == 1
                 else {name: inputs[name].numpy() for name in names})
        got = session.run(None, feeds)[0]
        difference, scale = float(np.abs(got - expected.numpy()).max()), float(expected.abs().max())
        checks["onnx_relative_diff"] = difference / scale
        checks["onnx_ok"] = got.shape == tuple(expected.shape) and scale > 0 and difference <= ONNX_RTOL * scale
    except Exception as e:  # the failure is the measurement
        checks.update(onnx_ok=False, onnx_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if is_decoder(model_type) and checks.get("reload_class"):
        try:
            prompt = inputs["input_ids"][:1, :4]
            tokens = stock.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            checks["generate_ok"] = tuple(tokens.shape) == (1, 12)
        except Exception as e:  # the failure is the measurement
            checks.update(generate_ok=False, generate_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return checks


def tp_recipe(model, model_type: str, ratio: float = RATIO, inputs: dict | None = None) -> None:
    """Prune ``model`` in place the way torch-pruning's LLM example does, then update the config fields it updates.

    ``ratio`` is the example's pruning ratio (heads and channels alike); ``inputs`` its example inputs
    (by default random ids for ``model_type``).
    """
    import torch
    import torch_pruning as tp

    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    num_heads, out_channel_groups = {}, {}
    for module in model.modules():
        for q, k, v in TP_HEAD_NAMES:
            if all(hasattr(module, name) for name in (q, k, v)):
                own = getattr(module, "num_attention_heads", heads)  # swin's stages differ
                num_heads.update({getattr(module, q): own, getattr(module, k): kv_heads if own == heads else own,
                                  getattr(module, v): kv_heads if own == heads else own})
        for name in TP_FUSED_NAMES:
            if isinstance(getattr(module, name, None), tp.ops.TORCH_LINEAR):
                num_heads[getattr(module, name)] = heads
        if hasattr(module, "gate_up_proj") and isinstance(module.gate_up_proj, tp.ops.TORCH_LINEAR):
            out_channel_groups[module.gate_up_proj] = 2
    # The output head: lm_head, or the last Linear of a classifier (roberta's is a dense + out_proj module).
    head = model.get_output_embeddings() or [m for m in model.classifier.modules() if isinstance(m, torch.nn.Linear)][-1]
    inputs = inputs if inputs is not None else example(model_type, batch=1)
    pruner = tp.pruner.MagnitudePruner(
        model, example_inputs=inputs, importance=tp.importance.GroupMagnitudeImportance(p=2, group_reduction="mean"),
        pruning_ratio=ratio, head_pruning_ratio=ratio, num_heads=num_heads, prune_num_heads=True,
        prune_head_dims=False, round_to=4, ignored_layers=[head], out_channel_groups=out_channel_groups,
        output_transform=lambda output: output.logits)
    pruner.step()
    # The config update of the example: hidden size from the head, heads from q (or fused qkv), MLP from gate.
    config.hidden_size = head.in_features
    for name, module in model.named_modules():
        if name.endswith("self_attn") and hasattr(module, "head_dim"):
            q_width = module.q_proj.out_features if hasattr(module, "q_proj") else module.qkv_proj.out_features // 3
            if heads == kv_heads:
                config.num_key_value_heads = q_width // module.head_dim
            config.num_attention_heads = q_width // module.head_dim
        elif name.endswith("mlp") and hasattr(module, "gate_proj"):
            config.intermediate_size = module.gate_proj.out_features
        elif name.endswith("mlp") and hasattr(module, "gate_up_proj"):
            config.intermediate_size = module.gate_up_proj.out_features // 2


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise ``TimeoutError`` in the main thread once ``seconds`` have passed (SIGALRM, so Unix only)."""
    def expire(signum, frame):
        raise TimeoutError(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_tp(model_type: str, work: Path) -> dict:
    """torch-pruning's recipe on a fresh copy: ok or its error, then whether the stock class reloads the result."""
    import torch
    import transformers

    model = build(model_type)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    try:
        with time_limit(TP_TIME_LIMIT_S):
            tp_recipe(model, model_type)
        with torch.no_grad():
            expected = model(**example(model_type)).logits
    except Exception as e:  # the failure is the measurement
        where = _innermost_frame(e) if isinstance(e, TimeoutError) else ""
        return {"tp_ok": False, "tp_error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}{where}"}
    row = {"tp_ok": True, "tp_seconds": round(time.perf_counter() - start, 1),
           "tp_params_ratio": round(sum(p.numel() for p in model.parameters()) / params, 4),
           "tp_after": shape_of(model.config)}
    try:
        model.save_pretrained(work / "tp")
        stock, info = getattr(transformers, AUTO_CLASS[model_type]).from_pretrained(work / "tp",
                                                                                   output_loading_info=True)
        wrong = {k: len(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        with torch.no_grad():
            difference = float((stock.eval()(**example(model_type)).logits - expected).abs().max())
        row["tp_reload_ok"] = not wrong and difference <= LOGITS_ATOL
        if not row["tp_reload_ok"]:
            row["tp_reload_error"] = f"keys: {wrong}" if wrong else f"logits differ by {difference:.2g}"
    except Exception as e:  # the failure is the measurement
        row.update(tp_reload_ok=False, tp_reload_error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
    return row


def _innermost_frame(error: BaseException) -> str:
    """Where a timed-out call was when the time ran out: `` in FUNCTION (FILE)``."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-2]  # [-1] is the alarm handler
    return f" in {frame.name} ({Path(frame.filename).name})"


def _shape_text(shape: dict | None) -> str:
    if not shape:
        return ""
    return "/".join(str(shape[key]) if shape[key] is not None else "-"
                    for key in ("heads", "kv_heads", "intermediate", "layers")).replace(" ", "")


def _mark(value) -> str:
    return {True: "yes", False: "**no**", None: ""}[value]


def markdown(data: dict) -> str:
    rows = data["rows"]
    width = [r for r in rows if not r["drop_blocks"]]
    ok = [r for r in width if r["status"] == "ok"]
    tp_reloads = [r for r in width if r.get("tp_reload_ok")]
    lines = [
        "# `optkit optimize` on Hugging Face folders (issue #29 development set), and torch-pruning's LLM recipe",
        "",
        f"Command: `{data['command']}`",
        "",
        *pin_lines("torch-pruning", data.get("torch_pruning")),
        f"Machine: {data['machine']}; torch {data['torch']}, transformers {data['transformers']}, torch-pruning "
        f"{data['torch_pruning']}, onnxruntime {data['onnxruntime']}. Each type: a tiny config "
        "(`benchmarks/_hf_configs.py`: hidden 64 (swin 32), 2 blocks (swin 2+2), 4 heads with 2 KV heads where the "
        "type has grouped-query attention, vocabulary 256, random weights) written with `save_pretrained`, then "
        f"`python -m optkit optimize DIR --prune {RATIO} --export onnx --no-latency --save-pt --seq-len {SEQ_LEN} --out OUT` "
        f"(`--input-shape 1,3,{IMAGE_SIZE},{IMAGE_SIZE}` for vit and swin). Checked here, apart from optkit: the "
        "stock `AutoModelFor…` class loads OUT with no missing, unexpected or mis-shaped keys and is the input's "
        f"class; its logits equal `optkit.load_model(OUT/model.pt)`'s (max |diff| ≤ {LOGITS_ATOL:g}); parameters "
        "≤ 0.8×; heads and MLP width both reduced; `OUT/model.onnx` in ONNX Runtime on fresh inputs within "
        f"{ONNX_RTOL:g} of the largest logit; decoders `generate` 8 tokens. MACs at sequence {MACS_SEQ_LEN} "
        f"(images {IMAGE_SIZE}×{IMAGE_SIZE}). Shapes are heads/KV heads/intermediate/layers, before → after.",
        "",
        f"**{len(ok)} of {len(width)}** types pass every check with optkit. torch-pruning's recipe, called "
        f"directly: {sum(bool(r.get('tp_ok')) for r in width)} of {len(width)} prune without an error, "
        f"{len(tp_reloads)} of {len(width)} reload with `from_pretrained` to the same logits.",
        "",
        "| type | optkit | CLI s | params | MACs | before → after | reload | logits = | ONNX rel. diff | generate "
        "| torch-pruning | tp params | tp reload |",
        "|---|---|---:|---:|---:|---|---|---|---:|---|---|---:|---|",
    ]
    for r in rows:
        name = r["type"] + (f" --drop-blocks {r['drop_blocks']}" if r["drop_blocks"] else "")
        result = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
        if r["status"] == "check failed":
            result += "; ".join(f" {r[k]}" for k in ("reload_error", "onnx_error", "generate_error") if k in r)
            failed = [k for k in ("reload_ok", "logits_equal", "params_ok", "width_ok", "onnx_ok", "generate_ok")
                      if r.get(k) is False]
            result += f" ({', '.join(failed)})"
        shapes = f"{_shape_text(r.get('before'))} → {_shape_text(r.get('after'))}" if r.get("after") else ""
        onnx = f"{r['onnx_relative_diff']:.1e}" if "onnx_relative_diff" in r else _mark(r.get("onnx_ok"))
        tp = "ok" if r.get("tp_ok") else r.get("tp_error", "")
        tp_reload = _mark(r.get("tp_reload_ok")) + (f": {r['tp_reload_error']}" if r.get("tp_reload_error") else "")
        lines.append(f"| {name} | {result} | {r.get('cli_seconds', '')} | {r.get('params_ratio', '')} | "
                     f"{r.get('macs_ratio', '')} | {shapes} | {_mark(r.get('reload_ok'))} | "
                     f"{_mark(r.get('logits_equal'))} | {onnx} | {_mark(r.get('generate_ok'))} | {tp} | "
                     f"{r.get('tp_params_ratio', '')} | {tp_reload} |")
    skipped = [f"- {r['type']}: {s}" for r in rows for s in r.get("skipped", [])]
    notes = [f"- {r['type']}: {n}" for r in rows for n in r.get("folder_notes", []) if "save_pretrained files" in n]
    lines += ["", "MACs are counted by `optkit.model.stats.count_macs` (torch-pruning's op counter), which counts "
              "`nn.Linear` but not transformers' `Conv1D`: gpt2's MACs ratio covers its lm_head only."]
    if skipped or notes:
        lines += ["", "What optkit left as it was, or could not write for the stock class (from report.json):", "",
                  *skipped, *notes]
    return "\n".join(lines) + "\n"


def type_arguments(doc: str, known: tuple[str, ...], time_limit: float,
                   among: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a benchmark over model types: ``--types`` (checked against ``known``), ``--out``,
    ``--time-limit``; with the types to run (all by default)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="only these types; the other rows are kept from the last run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results files")
    parser.add_argument("--time-limit", type=float, default=time_limit, help="seconds each CLI run may take")
    args = parser.parse_args()
    types = args.types or list(known)
    unknown = sorted(set(types) - set(known))
    if unknown:
        parser.error(f"not {among}: {', '.join(unknown)}")
    return args, types


def main() -> None:
    args, types = type_arguments(__doc__, DEV_SET, TIME_LIMIT_S, "in the development set")

    import onnxruntime
    import torch
    import torch_pruning
    import transformers

    path = args.out / "hf-zoo.json"
    previous = {}
    if args.types and path.exists():
        previous = {(r["type"], r["drop_blocks"]): r for r in json.loads(path.read_text())["rows"]}
    data = {
        "command": "python benchmarks/hf_zoo.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_pruning": torch_pruning.__version__, "onnxruntime": onnxruntime.__version__, "rows": [],
    }
    runs = [(t, 0) for t in DEV_SET] + [(t, 1) for t in DEPTH_RUNS]
    for model_type, drop_blocks in runs:
        if model_type not in types:
            if (model_type, drop_blocks) in previous:
                data["rows"].append(previous[(model_type, drop_blocks)])
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="optkit-hf-zoo-") as work:
            row = {"type": model_type, "drop_blocks": drop_blocks,
                   **run_optkit(model_type, Path(work), drop_blocks, args.time_limit)}
            if not drop_blocks:
                row.update(run_tp(model_type, Path(work)))
        row["seconds"] = round(time.perf_counter() - start, 1)
        data["rows"].append(row)
        print(f"{model_type} (drop {drop_blocks}): {row['status']} {row.get('error', '')} | torch-pruning "
              f"{'ok' if row.get('tp_ok') else row.get('tp_error', '-')} reload {row.get('tp_reload_ok', '-')}",
              flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "hf-zoo.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
