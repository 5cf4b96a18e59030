"""Before/after reports: a dict for ``report.json``, Markdown, a channels plot, and a console table."""

from __future__ import annotations

import os
from typing import Any

from optkit.analysis.generation import generation_lines
from optkit.analysis.latency import timing_flag
from optkit.core.pipeline import PipelineRun

NO_LATENCY_NOTE = (
    "Latency was not measured in this run: fewer MACs do not always mean proportionally "
    "less time. Time both models with `optkit bench --compare ORIGINAL model.pt`."
)
CHANNELS_PLOT = "channels.png"


def build_report(run: PipelineRun, *, model: str, input_shape: tuple[int, ...],
                 files: dict[str, int] | None = None, channels: dict[str, dict[str, int]] | None = None,
                 latency: dict[str, Any] | None = None, onnx_latency: dict[str, Any] | None = None,
                 accuracy: dict[str, Any] | None = None,
                 input_file_size: int | None = None) -> dict[str, Any]:
    """The report of one pipeline run as JSON-ready data.

    Args:
        run: the pipeline's outcome (stats must have been measured).
        model: the model spec it ran on.
        input_shape: the input shape MACs were counted at.
        files: output file names and their sizes in bytes.
        channels: ``{"before": {layer: out_channels}, "after": {...}}`` for
            conv/linear layers (see :func:`optkit.analysis.model_info.layer_channels`).
        onnx_latency: ONNX Runtime timings of the original and the result (see
            :func:`optkit.workflow.onnx_latency`).
        latency: ``{"before": {...}, "after": {...}}`` timings (``median_ms``,
            ``p90_ms``, ``spread``) when they were measured.
        accuracy: ``{"before": float | None, "after": float}`` (and optionally
            ``"dataset"``) when data was given; by default the validation
            accuracy a fine-tune pass reached, with "before" unmeasured.
        input_file_size: size in bytes of the checkpoint the model was read
            from, compared with ``model.pt`` in the report.

    Returns:
        ``{"model", "input_shape", "before", "after", "ratios", "passes", "files",
        "layers", "notes"}``, plus ``latency``/``accuracy`` when given;
        ``before``/``after`` hold ``params``, ``macs`` and ``sparsity``.
    """
    before, after = run.before.to_dict(), run.after.to_dict()
    ratios = {k: (after[k] / before[k] if before[k] else None) for k in ("params", "macs")}
    report: dict[str, Any] = {
        "model": model,
        "input_shape": list(input_shape),
        "before": before,
        "after": after,
        "ratios": ratios,
        "passes": [r.to_dict() for r in run.records],
        "files": files or {},
        "file_size": {"before": input_file_size, "after": (files or {}).get("model.pt")},
        "layers": _layer_rows(channels) if channels else [],
    }
    if latency is not None:
        report["latency"] = latency
    if onnx_latency is not None:
        report["onnx_latency"] = onnx_latency
    accuracy = accuracy if accuracy is not None else _finetune_accuracy(run)
    if accuracy is not None:
        report["accuracy"] = accuracy
    report["notes"] = _notes(run, report)
    return report


def _finetune_accuracy(run: PipelineRun) -> dict[str, Any] | None:
    """The validation accuracy the last fine-tune pass reached (its "before" was not measured)."""
    for record in reversed(run.records):
        if record.details.get("val_accuracy") is not None:
            data = record.details.get("data")
            return {"before": None, "after": record.details["val_accuracy"],
                    "dataset": f"the val split of {data}" if data else "the validation data"}
    return None


def _layer_rows(channels: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    before, after = channels.get("before", {}), channels.get("after", {})
    names = list(before) + [n for n in after if n not in before]
    return [{"name": n, "before": before.get(n), "after": after.get(n)} for n in names]


def _notes(run: PipelineRun, report: dict[str, Any]) -> list[str]:
    """The report's notes: what each pass said (``details["notes"]``), then what the figures show."""
    notes = [str(note) for record in run.records for note in record.details.get("notes", ())]
    for name, layers in skipped_layers(report).items():
        notes.append(f"{name} left {len(layers)} layer(s) untouched (listed under Skipped layers in report.md)")
    notes += _small_channel_cuts(run)
    notes += _ratio_drift(run, report["layers"])
    notes += _allocation_hint(run)
    if report.get("onnx_latency"):
        notes.append(onnx_latency_note(report["onnx_latency"]))
    elif "latency" not in report and report["ratios"]["macs"] is not None and report["ratios"]["macs"] < 1:
        notes.append(NO_LATENCY_NOTE)
    eager = report.get("latency") or {}
    flag = timing_flag(eager.get("before"), eager.get("after"))
    if flag:
        notes.append(f"PyTorch latency {flag}: re-time with `optkit bench --compare` on a quiet machine")
    spreads = [t.get("spread", 1.0) for t in eager.values() if isinstance(t, dict)]
    if not flag and spreads and max(spreads) > 1.2:
        notes.append(f"the latency figures are noisy (p90 / median up to {max(spreads):.2f}): other work was "
                     "competing for the machine; re-time with `optkit bench --compare` on a quiet machine")
    return notes


#: How far (as a fraction of the channels) the channels a ratio prune removed may be from the ratio without a note.
RATIO_DRIFT = 0.05


def _ratio_drift(run: PipelineRun, layers: list[dict[str, Any]]) -> list[str]:
    """A note when pruning at a plain ratio removed a share of channels well away from what was asked.

    Per-layer rounding (``round_to``) moves the share, and iterative steps
    (several prune passes at the same ratio ``r``, which compound to
    ``1 - (1 - r) ** k``) round at every step; the pruned layers' channel
    counts before and after show by how much. Target searches
    (``details["target"]``) and per-layer ratios are left alone.
    """
    steps = [r for r in run.records if isinstance(r.details.get("ratio"), (int, float)) and r.details["ratio"] > 0]
    changed = [row for row in layers if row["before"] and row["after"] is not None and row["after"] != row["before"]]
    ratios = {r.details["ratio"] for r in steps}
    if (not steps or len(ratios) != 1 or len({r.name for r in steps}) != 1 or not changed
            or any("target" in r.details or r.details.get("layer_ratios") for r in steps)):
        return []
    asked = 1 - (1 - ratios.pop()) ** len(steps)
    removed = sum(row["before"] - row["after"] for row in changed) / sum(row["before"] for row in changed)
    if abs(removed - asked) <= RATIO_DRIFT:
        return []
    example = max(changed, key=lambda row: abs((row["before"] - row["after"]) / row["before"] - asked))
    how = f" in {len(steps)} steps" if len(steps) > 1 else ""
    return [f"{steps[0].name} removed {removed:.0%} of the channels of the {len(changed)} layers it pruned{how}, not "
            f"the {asked:.0%} asked (e.g. {example['name']}: {example['before']} -> {example['after']}): each layer "
            "keeps a multiple of round_to channels, and iterative steps round at every step; --round-to 1 follows "
            "the ratio more closely, --target-macs aims at a MACs fraction instead"]


def _allocation_hint(run: PipelineRun) -> list[str]:
    """One line when a target prune allocated uniformly where measured data could have guided it: a transformer's
    heads/MLP split, or an image model's channels before a fine-tune.

    Sensitivity allocation is not the default because it costs a measurement pass and gained on one of the
    three models of ``benchmarks/results/defaults.md`` only; where it gained, it kept more than the noise.
    """
    prunes = [r for r in run.records if r.name == "structured_prune" and "target" in r.details]
    unmeasured = [r for r in prunes if "transformer" in r.details and r.details.get("allocation") != "mix"]
    if any(str(r.details.get("allocation", "")).startswith("uniform (split not measured") for r in unmeasured):
        return []  # the prune's own first note says why the split was not measured, and how to measure it
    if unmeasured:
        return ["structured_prune cut heads and MLP channels by the same share: given text data (--calib-data "
                "text), the default allocation splits the cut between them by validation perplexity, which kept "
                "test perplexity within 1.01x at 0.8 of the parameters on the shipped language model, where the "
                "same share gave about 2x (benchmarks/results/llm.md)"]
    tunes = [r for r in run.records if r.name == "finetune" and r.details.get("data")]
    if not prunes or not tunes or any(r.details.get("allocation") == "sensitivity" for r in prunes):
        return []
    data = tunes[0].details["data"]
    return [f"structured_prune allocated the MACs uniformly: `--allocation sensitivity --calib-data {data}` may keep "
            "more accuracy, at about 1.5x this run's time (benchmarks/results/defaults.md)"]


def onnx_latency_note(timing: dict[str, Any]) -> str:
    """One line on the realized ONNX Runtime speed-up next to the one the MACs promise, and the throughput in the
    unit of the model's kind when the timing gives what one call processes (``throughput``: a
    :class:`~optkit.kinds.Throughput` as a dict)."""
    larger = timing.get("at_batch") or {}
    flag = timing_flag(timing["before"], timing["after"], larger.get("before"), larger.get("after"))
    if flag:
        return (f"ONNX Runtime, batch 1, {timing['threads']} thread(s): {flag} ({timing['before']['median_ms']:.2f} "
                f"-> {timing['after']['median_ms']:.2f} ms median); re-time with `optkit bench --compare` on a quiet "
                "machine")
    line = (f"ONNX Runtime, batch 1, {timing['threads']} thread(s): {timing['before']['median_ms']:.2f} -> "
            f"{timing['after']['median_ms']:.2f} ms median, {timing['speedup']:.2f}x faster")
    if timing["ideal_speedup"]:
        line += f" (the MACs promise {timing['ideal_speedup']:.2f}x: efficiency {timing['efficiency']:.2f})"
    throughput = timing.get("throughput")
    if throughput:
        count = throughput["count"]
        line += (f"; {throughput['call']}: {count / timing['before']['median_ms'] * 1e3:,.0f} -> "
                 f"{count / timing['after']['median_ms'] * 1e3:,.0f} {throughput['unit']}/s")
    larger = timing.get("at_batch")
    if larger:
        line += (f"; at batch 1 this model's calls are largely ONNX Runtime's fixed cost per call, so also timed "
                 f"at batch {larger['batch_size']}: {larger['before']['median_ms']:.2f} -> "
                 f"{larger['after']['median_ms']:.2f} ms, {larger['speedup']:.2f}x faster")
        if larger["efficiency"] is not None:
            line += f" (efficiency {larger['efficiency']:.2f})"
    return line + f"; load average {timing['load_avg_1min']}"


def _small_channel_cuts(run: PipelineRun) -> list[str]:
    """A note for each pass that promises fewer MACs (``details["ratio"]`` > 0) yet removed under 5% of them."""
    notes = []
    macs = run.before.macs if run.before is not None else None
    for record in run.records:
        after = record.stats.macs if record.stats is not None else None
        if macs and after is not None and (record.details.get("ratio") or 0) > 0 and after / macs > 0.95:
            notes.append(f"{record.name} removed under 5% of the MACs: most channels were protected "
                         "(classifier, attention, ignored layers) or the ratio was small")
        macs = after if after is not None else macs
    return notes


def skipped_layers(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The layers each pass left untouched, by pass: ``{pass: {layer: reason}}``.

    Reads ``details.skipped_layers`` and ``details.held_layers`` (name -> reason
    mappings) or ``details.ignored_layers`` (a list of names) of each pass.
    """
    out: dict[str, dict[str, str]] = {}
    for p in report["passes"]:
        details = p.get("details") or {}
        skipped = {**(details.get("skipped_layers") or {}),
                   **{name: f"held at full width: {reason}" for name, reason in (details.get("held_layers") or {}).items()}}
        if skipped:
            out[p["name"]] = {str(k): str(v) for k, v in skipped.items()}
        elif details.get("ignored_layers"):
            out[p["name"]] = {str(n): "ignored (the classifier, or matched an ignored_layers pattern)"
                              for n in details["ignored_layers"]}
    return out


def _rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    before, after = report["before"], report["after"]
    rows = []
    for key, label in (("params", "Parameters"), ("macs", "MACs")):
        ratio = after[key] / before[key] if before[key] else float("nan")
        rows.append((label, f"{before[key]:,}", f"{after[key]:,}", f"{ratio:.3f}×"))
    rows.append(("Weight sparsity", f"{before['sparsity']:.1%}", f"{after['sparsity']:.1%}", ""))
    size = report.get("file_size") or {}
    if size.get("after"):
        b = size.get("before")
        rows.append(("File size (MB)", "-" if b is None else f"{b / 1e6:.2f}", f"{size['after'] / 1e6:.2f}",
                     f"{size['after'] / b:.3f}×" if b else ""))
    dtype = report.get("dtype") or {}
    if dtype.get("after"):
        disk = dtype.get("on_disk")
        rows.append(("Weights dtype", dtype.get("before") or "-",
                     dtype["after"] + (f" ({disk} on disk)" if disk and disk != dtype["after"] else ""), ""))
    timing = report.get("onnx_latency")
    if timing:
        b, a = timing["before"]["median_ms"], timing["after"]["median_ms"]
        rows.append((f"ONNX Runtime ms ({timing['threads']} thr, batch 1)", f"{b:.2f}", f"{a:.2f}",
                     _timed_ratio(b, a, timing["before"], timing["after"])))
        larger = timing.get("at_batch")
        if larger:
            b, a = larger["before"]["median_ms"], larger["after"]["median_ms"]
            rows.append((f"ONNX Runtime ms ({timing['threads']} thr, batch {larger['batch_size']})", f"{b:.2f}",
                         f"{a:.2f}", _timed_ratio(b, a, larger["before"], larger["after"])))
    for row in (row for section in report.values() if isinstance(section, dict)
                for row in section.get("latency_rows", ())):
        b, a = row["before_ms"], row["after_ms"]
        rows.append((row["label"], f"{b:.2f}", f"{a:.2f}", f"{a / b:.3f}×" if b else ""))
    for key, label in (("median_ms", "PyTorch ms, median"), ("p90_ms", "PyTorch ms, p90")):
        latency = report.get("latency") or {}
        if key in latency.get("before", {}) and key in latency.get("after", {}):
            b, a = latency["before"][key], latency["after"][key]
            rows.append((label, f"{b:.2f}", f"{a:.2f}", _timed_ratio(b, a, latency["before"], latency["after"])))
    accuracy = report.get("accuracy") or {}
    if accuracy.get("after") is not None:
        before = accuracy.get("before")
        rows.append(("Accuracy", "-" if before is None else f"{before:.2%}", f"{accuracy['after']:.2%}",
                     "" if before is None else f"{(accuracy['after'] - before) * 100:+.2f} pts"))
    return rows


def _timed_ratio(before_ms: float, after_ms: float, *timings: dict[str, Any]) -> str:
    """The after / before cell of a timing row: the ratio, or "not a result" when a timing was taken under load
    or too noisy (:func:`optkit.analysis.latency.timing_flag`; the notes say which)."""
    if timing_flag(*timings):
        return "not a result (load)"
    return f"{after_ms / before_ms:.3f}×" if before_ms else ""


def to_markdown(report: dict[str, Any], *, plot: str | None = None) -> str:
    """The report as Markdown (``report.md``).

    Args:
        report: what :func:`build_report` returned.
        plot: file name of the channels plot to embed, if one was written.
    """
    shape = "×".join(map(str, report["input_shape"]))
    lines = [f"# optkit report: {report['model']}", "", f"MACs counted at input shape {shape}.", "",
             "| | before | after | after / before |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in _rows(report)]
    accuracy = report.get("accuracy") or {}
    if accuracy.get("dataset"):
        lines += ["", f"Accuracy measured on {accuracy['dataset']}."]
    lines += ["", "## Passes", "", "| pass | seconds | params | MACs | sparsity | peak RSS (MiB) |",
              "|---|---:|---:|---:|---:|---:|"]
    for p in report["passes"]:
        peak = p.get("peak_rss_mb")
        lines.append(f"| {p['name']} | {p['seconds']:.2f} | {p.get('params', 0):,} | {p.get('macs', 0):,} | "
                     f"{p.get('sparsity', 0):.1%} | {'-' if peak is None else f'{peak:,.0f}'} |")
    lines += _memory_lines(report.get("memory"))
    lines += _channel_lines(report, plot)
    skipped = skipped_layers(report)
    if skipped:
        lines += ["", "## Skipped layers", ""]
        for name, layers in skipped.items():
            lines += [f"- {name}: `{layer}`: {reason}" for layer, reason in layers.items()]
    lines += _evaluation_lines(report.get("evaluation"))
    lines += _export_lines(report.get("export"))
    lines += deploy_lines(report.get("deploy"))
    if report.get("generation"):
        lines += ["", "## Generation", ""] + [f"- {line}" for line in generation_lines(report["generation"])]
    if report["files"]:
        lines += ["", "## Files", ""] + [f"- `{name}`: {size:,} bytes" for name, size in report["files"].items()]
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """The run's peak memory and each stage's (the ``memory`` section)."""
    if not memory:
        return []
    peak = memory.get("peak_rss_mb")
    lines = ["", "## Memory", "",
             f"Peak resident memory of the run (loading included): {'-' if peak is None else f'{peak:,.0f}'} MiB; "
             f"per stage: {memory.get('method', 'process RSS')}.", "",
             "| stage | seconds | peak RSS (MiB) | RSS after (MiB) |", "|---|---:|---:|---:|"]
    for row in memory.get("stages", ()):
        values = [row.get("peak_rss_mb"), row.get("end_rss_mb")]
        cells = ["-" if v is None else f"{v:,.0f}" for v in values]
        lines.append(f"| {row['stage']} | {row.get('seconds', 0):.2f} | {cells[0]} | {cells[1]} |")
    return lines


#: The columns of an ``evaluation`` section that does not list its own (an image classifier's).
CLASSIFIER_COLUMNS = ({"key": "accuracy", "label": "top-1 accuracy", "format": ".2%"},
                      {"key": "agreement", "label": "agreement with original", "format": ".2%"},
                      {"key": "mean_kl", "label": "mean KL", "format": ".4f"})


def _evaluation_columns(evaluation: dict[str, Any]) -> list[dict[str, str]]:
    return list(evaluation.get("columns") or CLASSIFIER_COLUMNS)


def evaluation_rows(evaluation: dict[str, Any]) -> list[tuple[str, ...]]:
    """``(stage, figure...)`` per stage of the ``evaluation`` section, formatted, in the order of its ``columns``
    (the model kind's scores: accuracy, agreement and mean KL for a classifier; perplexity first for a language model)."""
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    columns = _evaluation_columns(evaluation)
    return [(row["stage"], *(fmt(row.get(c["key"]), c["format"]) for c in columns)) for row in evaluation["stages"]]


def evaluation_table(evaluation: dict[str, Any]):
    """The ``evaluation`` section as a rich table for the console."""
    from rich.table import Table

    table = Table(title=_evaluation_title(evaluation))
    for column in ("stage", *(c["label"] for c in _evaluation_columns(evaluation))):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in evaluation_rows(evaluation):
        table.add_row(*row)
    return table


def _evaluation_title(evaluation: dict[str, Any]) -> str:
    unit = evaluation.get("unit", "images")
    return f"Evaluation on the first {evaluation['samples']:,} {evaluation['split']} {unit} of {evaluation['data']}"


def _evaluation_lines(evaluation: dict[str, Any] | None) -> list[str]:
    if not evaluation:
        return []
    labels = [c["label"] for c in _evaluation_columns(evaluation)]
    lines = ["", f"## {_evaluation_title(evaluation)}", "",
             "Agreement and KL compare each stage's predictions with the original model's on the same samples"
             + (f" (KL: exact over the original's {evaluation['kl_top_k']:,} most likely tokens per position, the rest "
                "of the vocabulary estimated from tokens drawn from the original's distribution)"
                if evaluation.get("kl_top_k") else "")
             + ".", "",
             "| " + " | ".join(["stage", *labels]) + " |", "|---|" + "---:|" * len(labels)]
    return lines + ["| " + " | ".join(row) + " |" for row in evaluation_rows(evaluation)]


def _channel_lines(report: dict[str, Any], plot: str | None) -> list[str]:
    changed = [row for row in report.get("layers", []) if row["before"] != row["after"]]
    if not report.get("layers"):
        return []
    lines = ["", "## Channels per layer", ""]
    if plot:
        lines += [f"![output channels per layer, before and after]({plot})", ""]
    if not changed:
        return lines + [f"No layer changed its output channels ({len(report['layers'])} conv/linear layers)."]
    lines += [f"{len(changed)} of {len(report['layers'])} conv/linear layers changed their output channels:", "",
              "| layer | before | after |", "|---|---:|---:|"]
    return lines + [f"| `{r['name']}` | {_count(r['before'])} | {_count(r['after'])} |" for r in changed]


def _export_lines(export: dict[str, Any] | None) -> list[str]:
    """The ONNX export section: what was written and how it was verified."""
    if not export:
        return []
    lines = ["", "## Export", "",
             f"`{export.get('path', 'model.onnx')}`: {export.get('exporter', '?')} exporter, opset {export.get('opset', '?')}, "
             f"{export.get('file_size', 0):,} bytes ({export.get('compressed_size', 0):,} gzipped).", ""]
    checks = export.get("verification") or []
    if checks:
        lines += ["Verified against PyTorch in ONNX Runtime on the same random inputs:", "",
                  "| batch | max abs diff | tolerance | passed |", "|---:|---:|---:|---|"]
        lines += [f"| {c['batch_size']} | {c['max_abs_diff']:.3g} | {c['tolerance']:.3g} | {'yes' if c['passed'] else 'no'} |"
                  for c in checks]
    return lines


def deploy_lines(deploy: dict[str, Any] | None) -> list[str]:
    """The ``deploy`` section: the rule, then every candidate with its check, its speed and why it was not chosen."""
    if not deploy:
        return []
    tokens = deploy.get("timed_as") in ("decode", "prefill")
    lines = ["", "## Deployment", "", f"{deploy['notes'][0]}.", "",
             f"Every candidate passed its check or is listed with why not; those that passed were timed with the "
             f"unpruned ONNX Runtime FP32 file at {deploy['threads']} thread(s). Going down the list (simplest "
             f"first), a candidate replaces the one kept so far only when it measures at least "
             f"{deploy.get('min_gain', 0):.0%} faster"
             + (f" per decode step (batch {deploy['batch_size']}, a KV cache after "
                f"{deploy.get('decode_prompt_tokens')} prompt tokens)." if deploy.get("timed_as") == "decode" else
                f", at batch {deploy['batch_size']}.")]
    limits = deploy.get("perplexity_limits")
    if limits:
        words = {"fp32": "FP32", "bf16": "bf16", "int8": "INT8", "w8": "weight-only INT8", "w4": "weight-only INT4"}
        lines += ["", "Validation perplexity limits (× the FP32 ONNX file's): "
                  + ", ".join(f"{words[k]} {v:g}×" for k, v in limits.items()) + "."]
    if tokens:
        lines += ["", "| candidate | status | perplexity × FP32 (limit) | decode graph × FP32 | prefill tokens/s | "
                  "decode tokens/s | speed-up | bytes | why not chosen |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    else:
        lines += ["", "| candidate | status | agreement | accuracy | ms | speed-up | bytes | why not chosen |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in deploy["candidates"]:
        check, latency = c.get("check") or {}, c.get("latency") or {}
        speed = "–" if c.get("speedup") is None else f"{c['speedup']:.2f}×"
        size = "–" if check.get("file_size") is None else f"{check['file_size']:,}"
        reason = (c.get("reason") or "").replace("|", "/")
        if tokens:
            ratio = check.get("perplexity_ratio")
            decode_ratio = (check.get("decode") or {}).get("perplexity_ratio")
            prefill = (c.get("prefill") or {}).get("tokens_per_s")
            decode = latency.get("tokens_per_s") if deploy["timed_as"] == "decode" else None
            cells = [f"{ratio:.4f} ({check['limit']:g})" if ratio is not None else "–",
                     "–" if decode_ratio is None else f"{decode_ratio:.4f}",
                     "–" if prefill is None else f"{prefill:,.0f}", "–" if decode is None else f"{decode:,.0f}"]
        else:
            agreement, accuracy = check.get("agreement"), check.get("accuracy")
            cells = ["–" if agreement is None else f"{agreement:.1%}",
                     "–" if accuracy is None else f"{accuracy:.2%}",
                     "–" if not latency else f"{latency['median_ms']:.2f}"]
        lines.append(f"| {c['name']} | {c['status']} | {' | '.join(cells)} | {speed} | {size} | {reason} |")
    return lines + budget_lines(deploy.get("budget"))


def budget_lines(budget: dict[str, Any] | None) -> list[str]:
    """A latency budget's frontier: each deployment pruned just enough, its measured latency and score, the chosen
    one marked, and the plot."""
    if not budget:
        return []
    metric = budget["metric"]
    lines = ["", "### Latency budget", "",
             f"Budget: {budget['asked']}. Each deployment that passed its checks was pruned just enough to meet it, "
             f"measured in its own runtime and timed once more (ms: the slower of the two); those that met it both times were scored on the data's val split and the best "
             f"{metric} was chosen. Efficiency is the measured speed-up in that deployment × the MACs kept (1.00: "
             "the time fell as much as the MACs).", "",
             f"| deployment | status | MACs kept | params kept | unpruned ms | ms | speed-up | efficiency | {metric} | "
             "tries | why not chosen |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    for p in budget["points"]:
        score = (p.get("score") or {}).get(metric)
        shown = cell(score, ".2%" if metric == "accuracy" else ".3f")
        name = f"**{p['name']}** (chosen)" if p["status"] == "chosen" else p["name"]
        reason = (p.get("reason") or "").replace("|", "/")
        lines.append(f"| {name} | {p['status']} | {cell(p.get('macs_fraction'), '.3f')} | "
                     f"{cell(p.get('params_fraction'), '.3f')} | {cell(p.get('unpruned_ms'), '.2f')} | "
                     f"{cell(p.get('ms'), '.2f')} | {cell(p.get('speedup'), '.2f')} | {cell(p.get('efficiency'), '.2f')}"
                     f" | {shown} | {len(p.get('tries') or [])} | {reason} |")
    if budget.get("remeasured_ms") is not None:
        lines += ["", f"The chosen deployment timed again by deploy: {budget['remeasured_ms']:.2f} ms against "
                      f"{budget['budget_ms']:.2f} ms ({'met' if budget['met_again'] else 'missed'})."]
    if budget.get("plot"):
        lines += ["", f"![{metric} against measured latency, each deployment pruned to the budget]({budget['plot']})"]
    return lines


def _count(value: int | None) -> str:
    return "not present" if value is None else str(value)


def plot_channels(report: dict[str, Any], path: str | os.PathLike) -> bool:
    """Draw output channels per conv/linear layer, before and after, as a PNG.

    Args:
        report: what :func:`build_report` returned (its ``layers``).
        path: where to write the PNG.

    Returns:
        whether a plot was written (``False`` for a model without conv/linear layers).
    """
    layers = report.get("layers") or []
    if not layers:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(layers)
    positions = range(n)
    figure = Figure(figsize=(min(24.0, max(6.0, 0.22 * n)), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.bar([i - 0.2 for i in positions], [row["before"] or 0 for row in layers], width=0.4, label="before")
    axes.bar([i + 0.2 for i in positions], [row["after"] or 0 for row in layers], width=0.4, label="after")
    step = max(1, n // 60)
    axes.set_xticks(list(positions)[::step], [row["name"] for row in layers][::step], rotation=90, fontsize=6)
    axes.set_ylabel("output channels")
    axes.set_title(f"{report['model']}: output channels per conv/linear layer")
    axes.legend()
    figure.savefig(os.fspath(path), dpi=100, format="png")
    return True


def print_report(report: dict[str, Any], console=None) -> None:
    """Print the before/after table (and notes) to the console with rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"optkit: {report['model']}")
    for column, justify in (("", "left"), ("before", "right"), ("after", "right"), ("after / before", "right")):
        table.add_column(column, justify=justify)
    for row in _rows(report):
        table.add_row(*row)
    console.print(table)
    if report.get("evaluation"):
        console.print(evaluation_table(report["evaluation"]))
    for p in report["passes"]:
        peak = f", peak RSS {p['peak_rss_mb']:,.0f} MiB" if p.get("peak_rss_mb") is not None else ""
        console.print(f"  {p['name']}: {p['seconds']:.2f} s{peak}")
    if (report.get("memory") or {}).get("peak_rss_mb") is not None:
        console.print(f"  peak RSS of the run: {report['memory']['peak_rss_mb']:,.0f} MiB (report.md lists each stage)")
    for line in generation_lines(report["generation"]) if report.get("generation") else ():
        console.print(f"[cyan]generation:[/cyan] {escape(line)}", highlight=False)
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
