"""``optkit optimize DIR --prune 0.3 --export onnx`` on Hugging Face types outside issue #29's development set.

The development set (``benchmarks/hf_zoo.py``) is what optkit was built against; these types
(``BEYOND`` in ``benchmarks/_hf_configs.py``: tiny configs, random weights) show how it does on architectures it
was not. Each goes through the same CLI path and the same checks as the development set, apart from optkit: the
stock class reloads OUT with no missing, unexpected or mis-shaped keys, its logits equal the pruned model's,
``OUT/model.onnx`` matches in ONNX Runtime, decoders generate; parameters, and heads/MLP before -> after. Where
optkit left a part whole, the report's first reason is quoted.

Usage (no timing is compared):

    python benchmarks/hf_beyond.py
    python benchmarks/hf_beyond.py --types falcon dinov2   # rerun some, keep the others' rows
    python benchmarks/hf_beyond.py --types esm focalnet    # types held out from both sets (HELD_OUT)

Writes benchmarks/results/hf-beyond.{json,md} for the ``BEYOND`` types and hf-held-out.{json,md} for the
``HELD_OUT`` ones (issue #41); a run of some types keeps the other rows of each file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _hf_configs import BEYOND, HELD_OUT, is_decoder, is_image  # noqa: E402
from hf_zoo import run_optkit, type_arguments  # noqa: E402

CHECKS = ("reload_ok", "logits_equal", "onnx_ok")
# Each set of types and the results file it writes.
SETS = (("hf-beyond", BEYOND, "Hugging Face types outside the development set", "`BEYOND`"),
        ("hf-held-out", HELD_OUT, "Hugging Face types held out from the development and beyond sets", "`HELD_OUT`"))


def works(row: dict, model_type: str) -> bool:
    """The CLI wrote a folder the stock class reloads to the same logits, with a matching ONNX file (and
    generation for a decoder), and at most 0.8x the parameters."""
    checks = CHECKS + (("generate_ok",) if is_decoder(model_type) else ())
    return row.get("exit_code") == 0 and all(row.get(c) for c in checks) and row.get("params_ok", False)


def markdown(rows: list[dict], command: str, title: str = SETS[0][2], listed: str = SETS[0][3]) -> str:
    good = [r for r in rows if r["works"]]
    lines = [
        f"# `optkit optimize` on {title}",
        "",
        f"Command: `{command}`. Each type: a tiny config ({listed} in `benchmarks/_hf_configs.py`), random weights, "
        "`save_pretrained`, then `python -m optkit optimize DIR --prune 0.3 --export onnx --no-latency` "
        "(`--seq-len 32`, or `--input-shape 1,3,32,32`). Checked apart from optkit as in `hf-zoo.md`.",
        "",
        f"**{len(good)} of {len(rows)}** types come back as a `save_pretrained` folder the stock class reloads to "
        "the same logits, with a matching ONNX file (and generation for decoders), at most 0.8x the parameters.",
        "",
        "| type | works | params | heads/KV/intermediate/layers before -> after | reload | logits = | ONNX | "
        "generate | what optkit said or what failed |",
        "|---|---|---:|---|---|---|---|---|---|",
    ]
    for row in rows:
        def mark(key: str) -> str:
            return "" if key not in row else "yes" if row[key] else "**no**"
        before, after = row.get("before") or {}, row.get("after") or {}
        shapes = " -> ".join("/".join("-" if v is None else str(v).replace(" ", "")
                                      for v in (s.get("heads"), s.get("kv_heads"), s.get("intermediate"),
                                                s.get("layers"))) for s in (before, after) if s)
        said = row.get("error") or next(iter(row.get("folder_notes") or []), None) or row.get("reload_error")
        said = said or row.get("onnx_error") or row.get("generate_error") or next(iter(row.get("skipped") or []), "")
        lines.append(f"| {row['type']} | {'yes' if row['works'] else '**no**'} | {row.get('params_ratio', '')} | "
                     f"{shapes} | {mark('reload_ok')} | {mark('logits_equal')} | {mark('onnx_ok')} | "
                     f"{mark('generate_ok')} | {str(said).replace('|', '/')[:300]} |")
    lines += ["", "`-` in a shape: the config has no such field (a convolutional model has no heads).", ""]
    return "\n".join(lines)


def main() -> None:
    args, types = type_arguments(__doc__, BEYOND + HELD_OUT, 300.0, "among the types beyond the development set")
    command = " ".join(["python benchmarks/hf_beyond.py", *sys.argv[1:]])
    for stem, known, title, listed in SETS:
        if any(t in types for t in known):
            run_set(args, types, stem, known, command, title, listed)


def run_set(args, types: list[str], stem: str, known: tuple[str, ...], command: str, title: str,
            listed: str) -> None:
    """Run the chosen types of one set; the set's other rows are kept from its last results file."""
    path = args.out / f"{stem}.json"
    previous = {r["type"]: r for r in json.loads(path.read_text())["rows"]} if args.types and path.exists() else {}
    rows = []
    for model_type in known:
        if model_type not in types:
            if model_type in previous:
                rows.append(previous[model_type])
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="optkit-hf-beyond-") as work:
            try:
                row = {"type": model_type, **run_optkit(model_type, Path(work), 0, args.time_limit)}
            except Exception as error:  # noqa: BLE001 - building the type failed: that is the row
                row = {"type": model_type, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        row["image"] = is_image(model_type)
        row["works"] = works(row, model_type)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{model_type}: {'works' if row['works'] else 'no'} params {row.get('params_ratio')}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        kept = [previous[t] for t in known[known.index(model_type) + 1:] if t in previous and t not in types]
        _write(path, json.dumps({"command": command, "rows": rows + kept}, indent=1, default=str) + "\n")
        _write(args.out / f"{stem}.md", markdown(rows + kept, command, title, listed))


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a stopped run leaves the last complete table)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
