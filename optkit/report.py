"""Before/after reports: a dict for ``report.json``, Markdown, and a console table."""

from __future__ import annotations

from typing import Any

from optkit.pipeline import PipelineRun

UNSTRUCTURED_NOTE = (
    "Unstructured pruning zeroes weights but keeps every tensor dense: dense kernels "
    "(PyTorch, ONNX Runtime) run no faster and the file is no smaller uncompressed. "
    "Use structured pruning for speed; zeros only shrink a compressed file."
)


def build_report(run: PipelineRun, *, model: str, input_shape: tuple[int, ...],
                 files: dict[str, int] | None = None) -> dict[str, Any]:
    """The report of one pipeline run as JSON-ready data.

    Args:
        run: the pipeline's outcome (stats must have been measured).
        model: the model spec it ran on.
        input_shape: the input shape MACs were counted at.
        files: output file names and their sizes in bytes.

    Returns:
        ``{"model", "input_shape", "before", "after", "ratios", "passes", "files", "notes"}``;
        ``before``/``after`` hold ``params``, ``macs`` and ``sparsity``.
    """
    before, after = run.before.to_dict(), run.after.to_dict()
    ratios = {k: (after[k] / before[k] if before[k] else None) for k in ("params", "macs")}
    notes = []
    if any(r.name == "l1_unstructured" for r in run.records):
        notes.append(UNSTRUCTURED_NOTE)
    for record in run.records:
        skipped = record.details.get("skipped_layers")
        if skipped:
            notes.append(f"{record.name} left {len(skipped)} layer(s) untouched: see passes[].details.skipped_layers")
    return {
        "model": model,
        "input_shape": list(input_shape),
        "before": before,
        "after": after,
        "ratios": ratios,
        "passes": [r.to_dict() for r in run.records],
        "files": files or {},
        "notes": notes,
    }


def _rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    before, after = report["before"], report["after"]
    rows = []
    for key, label in (("params", "Parameters"), ("macs", "MACs")):
        ratio = after[key] / before[key] if before[key] else float("nan")
        rows.append((label, f"{before[key]:,}", f"{after[key]:,}", f"{ratio:.3f}×"))
    rows.append(("Weight sparsity", f"{before['sparsity']:.1%}", f"{after['sparsity']:.1%}", ""))
    return rows


def to_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown (``report.md``)."""
    shape = "×".join(map(str, report["input_shape"]))
    lines = [f"# optkit report: {report['model']}", "", f"Input shape {shape}.", "",
             "| | before | after | after / before |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in _rows(report)]
    lines += ["", "## Passes", "", "| pass | seconds | params | MACs | sparsity |", "|---|---:|---:|---:|---:|"]
    for p in report["passes"]:
        lines.append(f"| {p['name']} | {p['seconds']:.2f} | {p.get('params', 0):,} | {p.get('macs', 0):,} | {p.get('sparsity', 0):.1%} |")
    if report["files"]:
        lines += ["", "## Files", ""] + [f"- `{name}`: {size:,} bytes" for name, size in report["files"].items()]
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def print_report(report: dict[str, Any], console=None) -> None:
    """Print the before/after table (and notes) to the console with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"optkit: {report['model']}")
    for column, justify in (("", "left"), ("before", "right"), ("after", "right"), ("after / before", "right")):
        table.add_column(column, justify=justify)
    for row in _rows(report):
        table.add_row(*row)
    console.print(table)
    for p in report["passes"]:
        console.print(f"  {p['name']}: {p['seconds']:.2f} s")
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
