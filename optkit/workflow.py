"""The ``optimize`` workflow: load, run a pipeline, write the slimmed model and its report."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optkit.io import checkpoint, confirmed
from optkit.core.errors import OptkitError
from optkit.export.onnx import export_onnx, weights_sizes
from optkit.analysis.evaluation import EvalSettings
from optkit.analysis.model_info import layer_channels
from optkit.io.models import LoadedModel
from optkit.io.outputs import StagedOutputs, prepare_output_dir
from optkit.core.pipeline import Pipeline
from optkit.analysis.report import CHANNELS_PLOT, build_report, plot_channels, to_markdown

OUTPUT_FILES = ("model.pt", "recipe.toml", "report.json", "report.md", CHANNELS_PLOT)
EXPORT_FILES = ("model.onnx", "model.onnx.data", "model.int8.onnx")
EXPORT_FORMATS = ("onnx",)
#: Below this many ms per batch-1 call, ONNX Runtime's own per-call cost is a large part of the time, so
#: the report also times a batch that takes about :data:`COMPUTE_MS`, where the model's work dominates.
OVERHEAD_BOUND_MS = 1.0
COMPUTE_MS = 4.0
MAX_COMPUTE_BATCH = 256


def check_runs(loaded: LoadedModel, input_shape: tuple[int, ...]) -> None:
    """Run one forward pass so a wrong input shape fails early with a clear message.

    Raises:
        OptkitError: naming the input shape and the option that sets it.
    """
    import torch

    from optkit.analysis.metrics import eval_mode, example_input

    model = loaded.model
    try:
        with eval_mode(model), torch.no_grad():
            model(example_input(model, input_shape))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        shape = ",".join(map(str, input_shape))
        raise OptkitError(f"the model does not run on input shape {shape} ({first}); set --input-shape to what it expects") from e


def data_normalization(pipeline: Pipeline) -> dict[str, dict[str, str]]:
    """The mean and std each dataset spec the passes read normalizes with, by spec (for the report and ONNX metadata)."""
    from optkit.data import dataset_info

    return {spec: dataset_info(spec).normalization() for spec in _dataset_specs(pipeline)}


def _dataset_specs(pipeline: Pipeline) -> list[str]:
    import dataclasses

    from optkit.core.contract import Pass
    from optkit.core.settings import declared

    specs: list[str] = []
    for step in [*pipeline.passes, pipeline.int8]:
        if isinstance(step, Pass) or dataclasses.is_dataclass(step):
            specs += [getattr(step, f.name) for f in dataclasses.fields(step)
                      if (d := declared(f)) is not None and d.dataset and getattr(step, f.name)]
    return list(dict.fromkeys(specs))


def check_data(pipeline: Pipeline) -> None:
    """Check every dataset spec the pipeline's passes will read, so a missing one fails before the first pass.

    Raises:
        DataError: naming the spec and what is missing.
    """
    from optkit.data import check_available

    for spec in _dataset_specs(pipeline):
        check_available(spec)


def optimize(loaded: LoadedModel, pipeline: Pipeline, out_dir: str | os.PathLike, *, force: bool = False,
             on_pass: Callable[[int, int, str], None] | None = None, export: str | None = None,
             latency: bool | None = None, evaluation: EvalSettings | None = None) -> dict[str, Any]:
    """Run ``pipeline`` on a loaded model and write ``model.pt``, ``recipe.toml``, ``report.json``, ``report.md``
    and ``channels.png`` (output channels per layer, before and after).

    All files appear together at the end, or none do (a failure leaves
    ``out_dir`` as it was). In a distributed run only rank 0 writes. With
    ``export="onnx"``, a verified ``model.onnx`` is written too (see
    :func:`optkit.export.onnx.export_onnx`) and the report gets an ``export``
    section with the compressed size of the weights before and after. With
    ``latency=True``, the model is also timed before and after the passes
    (PyTorch eager, where it lives). Unless ``latency=False``, a run that
    exports ONNX times the original and the result in ONNX Runtime, interleaved,
    at batch 1 with every core (:func:`onnx_latency`), and the report puts the
    realized speed-up next to the MACs ratio. With ``evaluation``, the original
    model and the result after every pass, the ONNX file and the INT8 file are
    scored on the same test images (see :mod:`optkit.analysis.evaluation`).

    Returns:
        the report (as written to ``report.json``).

    Raises:
        OptkitError: for an unusable output folder, a model that does not run
            at the pipeline's input shape, or a failing pass (``PassError``).
        ExportError: when the exported model does not verify (nothing is written).
    """
    from optkit.passes.finetune.distributed import is_main_process

    if export is not None and export not in EXPORT_FORMATS:
        raise OptkitError(f"unknown export format {export!r}; choose from {', '.join(EXPORT_FORMATS)}")
    if pipeline.int8 is not None and export != "onnx":
        raise OptkitError("INT8 quantizes the exported ONNX model: add --export onnx")
    # Under torchrun every rank runs the pipeline (pruning identically, then training
    # together); only rank 0 writes.
    main = is_main_process()
    # Every file a run may write needs --force to replace: one this run does not
    # write is removed when its results are published (see StagedOutputs).
    out = prepare_output_dir(out_dir, OUTPUT_FILES + EXPORT_FILES, force=force) if main else None
    check_runs(loaded, pipeline.input_shape)
    check_data(pipeline)
    scorer = Scorer(evaluation, loaded.model, pipeline.input_shape) if evaluation is not None else None
    # Measured now: the passes change the model in place.
    weights_before = weights_sizes(loaded.model) if export and main else None
    channels = {"before": layer_channels(loaded.model)}
    timings = {"before": time_model(loaded.model, pipeline.input_shape)} if latency else None
    with tempfile.TemporaryDirectory(prefix="optkit-original-") as scratch:
        original_onnx = (_export_original(loaded.model, Path(scratch), pipeline.input_shape)
                         if export == "onnx" and latency is not False and main else None)
        return _run_and_write(loaded, pipeline, out, main=main, on_pass=on_pass, export=export, scorer=scorer,
                              weights_before=weights_before, channels=channels, timings=timings,
                              original_onnx=original_onnx)


def _run_and_write(loaded: LoadedModel, pipeline: Pipeline, out, *, main: bool, on_pass, export: str | None,
                   scorer: Scorer | None, weights_before, channels: dict, timings: dict | None,
                   original_onnx: Path | None) -> dict[str, Any]:
    """Run the passes, then write every output together (see :func:`optimize`)."""
    run = pipeline.run(loaded.model, on_pass=on_pass if main else None,
                       after_pass=scorer.after_pass if scorer is not None else None)
    channels["after"] = layer_channels(checkpoint.unwrap(run.model))
    if timings is not None:
        timings["after"] = time_model(run.model, pipeline.input_shape)
    recipe_text = pipeline.to_toml()
    if not main:
        return build_report(run, model=loaded.source, input_shape=pipeline.input_shape)
    with StagedOutputs(out, superseded=OUTPUT_FILES + EXPORT_FILES) as staged:
        checkpoint.save(run.model, staged.path("model.pt"), loaded.arch, extra={"recipe": recipe_text})
        staged.path("recipe.toml").write_text(recipe_text, encoding="utf-8")
        files = {"model.pt": staged.path("model.pt").stat().st_size}
        normalization = data_normalization(pipeline)
        exported = _export(staged, run.model, pipeline, weights_before, onnx_metadata(normalization)) if export else {}
        files.update({name: section["file_size"] for name, section in exported.items()})
        onnx_timing = (onnx_latency(original_onnx, staged.path("model.onnx"), pipeline.input_shape,
                                    run.after.macs / run.before.macs if run.before.macs else None)
                       if original_onnx is not None else None)
        source = Path(loaded.source)
        report = build_report(run, model=loaded.source, input_shape=pipeline.input_shape, files=files,
                              channels=channels, input_file_size=source.stat().st_size if source.is_file() else None,
                              latency=timings, onnx_latency=onnx_timing)
        for name, section in exported.items():
            report["export" if name == "model.onnx" else "int8"] = section
            report["notes"].extend(section["notes"])
            if scorer is not None:
                scorer.score_onnx(name, staged.path(name))

        if scorer is not None:
            report["evaluation"] = scorer.section()
            report["accuracy"] = scorer.accuracy()
        if normalization:
            report["data"] = normalization
        if loaded.arch is None:
            report["notes"].append("the input was a whole pickled module, so model.pt is one too: loading it needs --trust")
        staged.path("report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        plot = CHANNELS_PLOT if plot_channels(report, staged.path(CHANNELS_PLOT)) else None
        staged.path("report.md").write_text(to_markdown(report, plot=plot), encoding="utf-8")
    _remember_architecture(loaded, out)
    return report


class Scorer:
    """Scores the original model and each stage's result on the same test images, for the report."""

    def __init__(self, settings: EvalSettings, model, input_shape: tuple[int, ...]):
        from optkit.analysis import evaluation

        self.settings = settings
        self.eval_set = evaluation.load_eval_set(settings, model, input_shape)
        self.reference = evaluation.torch_logits(model, self.eval_set, settings.batch_size)
        self.stages = [{"stage": "original", **evaluation.score(self.reference, self.eval_set)}]

    def after_pass(self, record, model) -> None:
        """Score the model after a pass (a ``Pipeline.run`` ``after_pass`` hook)."""
        from optkit.analysis import evaluation

        logits = evaluation.torch_logits(model, self.eval_set, self.settings.batch_size)
        self.stages.append({"stage": f"after {record.name}", **evaluation.score(logits, self.eval_set, self.reference)})

    def score_onnx(self, name: str, path: Path) -> None:
        """Score an exported file in ONNX Runtime."""
        from optkit.analysis import evaluation

        logits = evaluation.onnx_logits(path, self.eval_set, self.settings.batch_size)
        self.stages.append({"stage": f"{name} (ONNX Runtime)", **evaluation.score(logits, self.eval_set, self.reference)})

    def section(self) -> dict[str, Any]:
        """The report's ``evaluation`` section."""
        return {"data": self.eval_set.spec, "split": "test", "samples": len(self.eval_set.images),
                "stages": self.stages}

    def accuracy(self) -> dict[str, Any]:
        """The report's ``accuracy``: the original and the result (``model.pt``) on the same test images.

        It replaces the fine-tune pass's validation accuracy, which is measured on other images and
        has no "before".
        """
        torch_stages = [stage for stage in self.stages if not stage["stage"].endswith("(ONNX Runtime)")]
        return {"before": self.stages[0]["accuracy"], "after": torch_stages[-1]["accuracy"],
                "dataset": f"the first {len(self.eval_set.images):,} test images of {self.eval_set.spec}"}


def _remember_architecture(loaded: LoadedModel, out_dir: Path) -> None:
    """Let later commands reload this run's ``model.pt`` of the user's own class without ``--arch`` again.

    The architecture was confirmed when the model loaded (``--arch``, or a file
    optkit remembered); see :mod:`optkit.io.confirmed`.
    """
    if loaded.arch is not None and not loaded.arch.spec.startswith("torchvision:"):
        confirmed.remember(Path(out_dir) / "model.pt", loaded.arch.spec)


def _export_original(model, folder: Path, input_shape: tuple[int, ...]) -> Path:
    """Export the model as it is before the passes, to time it against the result."""
    path = folder / "original.onnx"
    export_onnx(model, path, input_shape)
    return path


def onnx_latency(original: Path, result: Path, input_shape: tuple[int, ...], macs_ratio: float | None, *,
                 threads: int | None = None, warmup: int = 5, repeats: int = 30) -> dict[str, Any]:
    """ONNX Runtime latency of the original and the result at batch 1, interleaved, and the realized speed-up.

    Args:
        original, result: the two ONNX files.
        input_shape: the model input; timed at batch 1.
        macs_ratio: MACs after / before, for the speed-up the MACs promise.
        threads: intra-op threads (default: every core, as users deploy).
        warmup, repeats: untimed and timed calls of each file.

    When the original takes under :data:`OVERHEAD_BOUND_MS` per call and both files take any batch,
    the two are also timed at the power-of-two batch (at most :data:`MAX_COMPUTE_BATCH`) where the
    original takes about :data:`COMPUTE_MS`: at batch 1 such a model's time is largely ONNX Runtime's
    fixed cost per call, which pruning cannot remove.

    Returns:
        ``threads``, ``batch_size``, the two :class:`Latency` dicts, ``speedup`` (original / result
        median), ``ideal_speedup`` (1 / MACs ratio), ``efficiency`` (their ratio) and the load average;
        ``at_batch`` holds the same figures at the larger batch when it was timed.
    """
    from optkit.analysis.latency import interleaved_latency

    threads = threads or os.cpu_count() or 1
    ideal = 1 / macs_ratio if macs_ratio else None

    def timed(batch: int) -> dict[str, Any]:
        before, after = interleaved_latency([original, result], (batch, *input_shape[1:]), threads=threads,
                                            warmup=warmup, repeats=repeats)
        speedup = before.median_ms / after.median_ms if after.median_ms else float("inf")
        return {"batch_size": batch, "before": before.to_dict(), "after": after.to_dict(),
                "speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3) if ideal else None,
                "efficiency": round(speedup / ideal, 3) if ideal else None}

    timing = {"engine": "onnxruntime", "threads": threads, **timed(1)}
    first_ms = timing["before"]["median_ms"]
    if 0 < first_ms < OVERHEAD_BOUND_MS and _takes_any_batch(original) and _takes_any_batch(result):
        timing["at_batch"] = timed(max(2, min(MAX_COMPUTE_BATCH, 2 ** math.ceil(math.log2(COMPUTE_MS / first_ms)))))
    timing["load_avg_1min"] = round(os.getloadavg()[0], 2)
    return timing


def _takes_any_batch(path: Path) -> bool:
    """Whether the ONNX file's single input has a symbolic batch dimension."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    dims = inputs[0].type.tensor_type.shape.dim if len(inputs) == 1 else []
    return bool(dims) and not dims[0].HasField("dim_value")


def time_model(model, input_shape: tuple[int, ...]) -> dict[str, Any]:
    """Eager PyTorch latency of one call at ``input_shape``, on the model's own device, for the report."""
    from optkit.analysis.latency import bench_torch
    from optkit.analysis.metrics import model_device

    (result,) = bench_torch(model, input_shape, device=str(model_device(model)), warmup=3, repeats=20)
    return {k: v for k, v in result.to_dict().items() if k in ("engine", "device", "threads", "median_ms", "p90_ms", "spread", "repeats")}


def onnx_metadata(normalization: dict[str, dict[str, str]]) -> dict[str, str]:
    """ONNX ``metadata_props`` naming the input normalization the model was trained or calibrated with.

    Recorded only when the passes read one dataset spec, so the values are unambiguous.
    """
    if len(normalization) != 1:
        return {}
    ((spec, values),) = normalization.items()
    return {"optkit.data": spec, "optkit.input_mean": values["mean"], "optkit.input_std": values["std"]}


def _export(staged, model, pipeline: Pipeline, weights_before: dict[str, int],
            metadata: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Write ``model.onnx`` (and ``model.int8.onnx`` with INT8 settings) into the staging folder.

    Returns:
        the report section of each file written, by file name.
    """
    sections = {"model.onnx": _export_onnx(model, staged.path("model.onnx"), pipeline.input_shape, weights_before,
                                           metadata)}
    if pipeline.int8 is not None:
        sections["model.int8.onnx"] = quantize_exported(staged.path("model.onnx"), staged.path("model.int8.onnx"),
                                                        pipeline.int8, pipeline.input_shape)
    return sections


def quantize_exported(fp32_path: Path, int8_path: Path, settings, input_shape: tuple[int, ...]) -> dict[str, Any]:
    """Quantize an exported file to INT8 (verified on the task) and time both, for the report.

    Raises:
        DataError, ExportError: as :func:`optkit.passes.quantize.quantize_onnx` does; nothing is written then.
    """
    from optkit.passes.quantize import compare_latency, quantize_onnx

    result = quantize_onnx(fp32_path, int8_path, settings, input_shape=input_shape).to_dict()
    result["path"] = Path(int8_path).name
    result["file_size"] = result["int8_size"]
    result["latency"] = compare_latency(fp32_path, int8_path, input_shape, threads=(os.cpu_count() or 1,))
    check = f"agreement {result['agreement']:.1%} with FP32"
    if result.get("accuracy_int8") is not None:
        check += f", accuracy {result['accuracy_fp32']:.2%} -> {result['accuracy_int8']:.2%}"
    timing = "; ".join(f"batch {r['batch_size']}, {r['threads']} thread(s): {r['fp32']['median_ms']:.2f} -> "
                       f"{r['int8']['median_ms']:.2f} ms" for r in result["latency"]["runs"])
    result["notes"] = [f"{Path(int8_path).name}: {result['mode']} INT8, {result['fp32_size']:,} -> "
                       f"{result['int8_size']:,} bytes, {check}; ONNX Runtime {timing}", *result["notes"]]
    return result


def _export_onnx(model, path, input_shape: tuple[int, ...], weights_before: dict[str, int],
                 metadata: dict[str, str]) -> dict[str, Any]:
    """Export ``model`` to ``path`` and describe it for the report, with weight sizes before and after the passes."""
    result = export_onnx(model, path, input_shape, metadata=metadata or None).to_dict()
    result["path"] = os.path.basename(result["path"])
    after = weights_sizes(model)
    result["weights_before"], result["weights_after"] = weights_before, after
    checks = "; ".join(f"batch {v['batch_size']}: max |diff| {v['max_abs_diff']:.2g} <= {v['tolerance']:.2g}"
                       for v in result["verification"])
    result["notes"] = [f"model.onnx: {result['exporter']} exporter, opset {result['opset']}, verified against PyTorch "
                       f"in ONNX Runtime ({checks})",
                       f"weights: {weights_before['weights']:,} -> {after['weights']:,} bytes raw, "
                       f"{weights_before['weights_gzip']:,} -> {after['weights_gzip']:,} bytes gzipped",
                       *result["notes"]]
    return result
