"""``optkit bench``: latency of a model (PyTorch eager), an ONNX file (ONNX Runtime) or an OpenVINO IR, or two
compared."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import click

from optkit.analysis.latency import ENGINES
from optkit.cli._options import model_options
from optkit.runtime.openvino import PRECISIONS


@click.command("bench")
@click.argument("model", required=False)
@click.option("--compare", nargs=2, metavar="A B", help="Benchmark two models the same way and print the ratio A / B.")
@click.option("--batch-size", "batch_sizes", type=click.IntRange(min=1), multiple=True,
              help="Batch size to time; repeat for several (e.g. --batch-size 1 --batch-size 8).")
@click.option("--engine", "engines", type=click.Choice(ENGINES), multiple=True,
              help="torch (eager), onnxruntime or openvino (CPU); repeat for several. Default: torch for a model, "
                   "onnxruntime for a .onnx file, openvino for a .xml file (a model is exported and verified "
                   "first).")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="OpenVINO: the precision to compute in (default: the one the .xml records, else fp32; bf16 "
                   "needs a CPU with bf16 instructions).")
@click.option("--threads", type=click.IntRange(min=1), help="Intra-op threads (default: the engine's own choice).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed calls before timing.")
@click.option("--repeats", type=click.IntRange(min=1), default=30, show_default=True, help="Timed calls per batch size.")
@model_options("Input shape, e.g. 1,3,224,224 (ONNX files: defaults to the file's declared shape).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON.")
def bench_command(model: str | None, compare: tuple[str, str] | None, as_json: bool, **options: Any) -> None:
    """Time inference of MODEL: median, p90 and spread (p90 / median) over repeats.

    MODEL is a model spec (timed in PyTorch eager), a .onnx file (timed in
    ONNX Runtime) or an OpenVINO IR .xml (timed in OpenVINO at the precision it
    records). With --compare A B, both are timed the same way, on inputs of the
    same shape, and the ratio of their medians is printed (above 1: B is
    faster); two files in different runtimes compare by batch size.

    Example: optkit bench --compare optkit/demo/fashion_resnet.pt runs/demo/model.pt
    """
    if (model is None) == (compare is None):
        raise click.UsageError("give one MODEL, or --compare A B")
    specs = [model] if model is not None else list(compare)
    prepared = [_prepare(spec, options) for spec in specs]
    if compare is not None:
        _check_same_input(*((spec, shape) for spec, (_, shape) in zip(specs, prepared)))
    runs = {spec: _time(spec, *ready, options) for spec, ready in zip(specs, prepared)}
    pairs = None
    if compare is not None:
        from optkit.analysis.latency import compare as pair_up

        _check_same_input(*((spec, _call_shape(runs[spec])) for spec in specs))
        pairs = pair_up(runs[specs[0]], runs[specs[1]])
    if as_json:
        data: dict[str, Any] = {"results": {spec: [r.to_dict() for r in results] for spec, results in runs.items()}}
        if pairs is not None:
            data["compare"] = {"a": specs[0], "b": specs[1], "pairs": pairs}
        click.echo(json.dumps(data, indent=2))
        return
    _print(runs, specs, pairs)


def _prepare(spec: str, options: dict[str, Any]) -> tuple[Any, tuple[int, ...] | None]:
    """The loaded model (``None`` for an ONNX file) and the input shape it will be timed at (``None``: the file's)."""
    from optkit.analysis import latency as bench

    engines = set(_engines(spec, options))
    if options["precision"] is not None and "openvino" not in engines:
        raise click.UsageError("--precision sets OpenVINO's precision: add --engine openvino or bench a .xml file")
    if "openvino" in engines and options["device"] != "cpu":
        raise click.UsageError("optkit runs OpenVINO on the CPU: use --device cpu with --engine openvino")
    if bench.is_openvino(spec) and engines - {"openvino"}:
        raise click.UsageError(f"{spec} is an OpenVINO IR: it runs only with --engine openvino")
    if bench.is_onnx(spec) or bench.is_openvino(spec):
        if engines - {"onnxruntime", "openvino"}:
            raise click.UsageError(f"{spec} is an ONNX file: it runs only with --engine onnxruntime or --engine openvino")
        return None, options["input_shape"]
    from optkit.io import models

    loaded = models.load(spec, arch=options["arch"], num_classes=options["num_classes"], trust=options["trust"])
    return loaded, options["input_shape"] or models.infer_input_shape(loaded)


def _check_same_input(a: tuple[str, tuple[int, ...] | None], b: tuple[str, tuple[int, ...] | None]) -> None:
    """Refuse to compare two models timed on inputs of different shapes (their ratio would compare different work)."""
    from optkit.core.errors import OptkitError

    (spec_a, shape_a), (spec_b, shape_b) = a, b
    if shape_a is None or shape_b is None or tuple(shape_a[1:]) == tuple(shape_b[1:]):
        return
    raise OptkitError(f"A ({spec_a}) takes {_sample(shape_a)} inputs but B ({spec_b}) takes {_sample(shape_b)}, so their "
                      "times are not comparable; compare models of the same input, or give an --input-shape both take")


def _sample(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape[1:]))


def _call_shape(results: list) -> tuple[int, ...] | None:
    return tuple(results[0].input_shape) if results else None


def _engines(spec: str, options: dict[str, Any]) -> tuple[str, ...]:
    """The engines asked, else the one a spec runs in by default (its runtime for a file, eager PyTorch for a model)."""
    from optkit.analysis import latency as bench

    if options["engines"]:
        return tuple(dict.fromkeys(options["engines"]))
    return ("openvino",) if bench.is_openvino(spec) else ("onnxruntime",) if bench.is_onnx(spec) else ("torch",)


def _time(spec: str, loaded: Any, shape: tuple[int, ...] | None, options: dict[str, Any]):
    from optkit.analysis import latency as bench

    # A timing taken on a loaded machine (or too noisy) is taken again once; if still so, its row is flagged.
    timing = {**{k: options[k] for k in ("threads", "warmup", "repeats")}, "retries": 1}
    batch_sizes = list(options["batch_sizes"]) or None
    results = []
    for engine in _engines(spec, options):
        if engine == "torch":
            results += bench.bench_torch(loaded.model, shape, batch_sizes=batch_sizes, device=options["device"],
                                         **timing)
            continue
        with _as_file(spec, loaded, shape) as path:
            if engine == "openvino":
                results += bench.bench_openvino(path, shape, batch_sizes=batch_sizes, precision=options["precision"],
                                                **timing)
            else:
                results += bench.bench_onnx(path, shape, batch_sizes=batch_sizes, device=options["device"], **timing)
    return results


@contextlib.contextmanager
def _as_file(spec: str, loaded: Any, shape: tuple[int, ...] | None) -> Iterator[str]:
    """The file a runtime times: the file ``spec`` names, or the loaded model exported to a temporary ONNX file with
    a dynamic batch (verified against PyTorch before it is timed)."""
    if loaded is None:
        yield spec
        return
    from optkit.export.onnx import export_onnx

    with tempfile.TemporaryDirectory(prefix="optkit-bench-") as folder:
        path = os.path.join(folder, "model.onnx")
        export_onnx(loaded.model, path, shape, dynamic_batch=True)
        yield path


def _print(runs: dict[str, list], specs: list[str], pairs: list[dict[str, Any]] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        # Piped or captured output has no width to respect: don't fold names and numbers.
        console = Console(width=200)
    table = Table(title="latency per call in ms (median, p90; spread = p90 / median)")
    for column in ("model", "engine", "threads", "input", "median", "p90", "spread", "items/s"):
        table.add_column(column, justify="left" if column in ("model", "engine") else "right", overflow="fold")
    for spec in specs:
        for r in runs[spec]:
            threads = "default" if r.threads is None else str(r.threads)
            where = f"{r.device}, {r.precision}" if r.precision else r.device
            table.add_row(spec, f"{r.engine} ({where})", threads, "×".join(map(str, r.input_shape)),
                          f"{r.median_ms:.2f}", f"{r.p90_ms:.2f}", f"{r.spread:.2f}", f"{r.throughput:,.1f}")
    console.print(table)
    flagged = [(spec, r) for spec in specs for r in runs[spec] if r.flag()]
    for spec, r in flagged:
        console.print(f"note: {spec} ({r.engine}, batch {r.batch_size}): {r.flag()}", markup=False, highlight=False)
    if not flagged and any(r.spread > 1.2 for results in runs.values() for r in results):
        console.print("note: p90 is over 20% above the median for some rows; the machine was noisy, "
                      "so repeat (more --repeats, fewer other jobs) before trusting small differences.")
    for pair in pairs or []:
        verdict = "within the noise" if pair["noisy"] else ("B is faster" if pair["speedup"] > 1 else "A is faster")
        if pair.get("not_a_result"):
            verdict = f"not a result: {pair['not_a_result']}"
        console.print(f"{pair['engine']} batch {pair['batch_size']}: A / B = {pair['speedup']:.2f} "
                      f"({pair['a_median_ms']:.2f} ms vs {pair['b_median_ms']:.2f} ms; {verdict})")
    if pairs == []:
        console.print("no common (engine, batch size) to compare: time both the same way")
