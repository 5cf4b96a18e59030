"""The ``optimize`` workflow: load, run a pipeline, write the slimmed model and its report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optkit.analysis.evaluation import EvalSettings
from optkit.analysis.model_info import layer_channels
from optkit.analysis.report import CHANNELS_PLOT, build_report, plot_channels, to_markdown
from optkit.core.context import RunContext
from optkit.core.errors import OptkitError
from optkit.core.forms import TORCH
from optkit.core.memory import METHOD as MEMORY_METHOD
from optkit.core.memory import PeakRss, peak_rss
from optkit.core.pipeline import Pipeline
from optkit.export.onnx import export_onnx, weights_sizes
from optkit.io import checkpoint, confirmed
from optkit.io.hf import PRETRAINED_FILES, safetensors_header
from optkit.io.models import LoadedModel
from optkit.io.outputs import StagedOutputs, prepare_output_dir, removed_if_left_empty, scratch_folder
from optkit.kinds import ModelKind, kind_of
from optkit.kinds.base import eval_progress
from optkit.passes.deploy.passes import FRONTIER_PLOT, OPENVINO_FILES
from optkit.runtime.openvino import missing_note as missing_openvino_note

OUTPUT_FILES = ("model.pt", "recipe.toml", "report.json", "report.md", CHANNELS_PLOT)
#: The slimmed checkpoint: written for models no stock class describes, or when asked (``save_pt``).
CHECKPOINT_FILE = "model.pt"
EXPORT_FILES = ("model.onnx", "model.onnx.data", "model.decode.onnx", "model.decode.onnx.data", "model.int8.onnx",
                *OPENVINO_FILES, FRONTIER_PLOT)
#: Every file a run may write (a transformer is also written as a save_pretrained folder).
RUN_FILES = OUTPUT_FILES + EXPORT_FILES + PRETRAINED_FILES
#: Below this many ms per batch-1 call, ONNX Runtime's own per-call cost is a large part of the time, so
#: the report also times a batch that takes about :data:`COMPUTE_MS`, where the model's work dominates.
OVERHEAD_BOUND_MS = 1.0
COMPUTE_MS = 4.0
MAX_COMPUTE_BATCH = 256


def check_runs(loaded: LoadedModel, input_shape: tuple[int, ...], *, origin: str | None = None) -> None:
    """Run one forward pass on the kind's example inputs so a wrong input shape or kind fails early, in one line.

    Args:
        loaded: the model.
        input_shape: the example input shape.
        origin: where the shape came from when the user did not give it (``recipe FILE``).

    Raises:
        OptkitError: naming the input shape and the option that sets it (``--seq-len`` or
            ``--kind`` where the model looks like it takes token ids; ``--input-shape`` and
            ``--num-classes`` to override a recipe's shape).
    """
    import torch

    from optkit.kinds import example_inputs, kind_of
    from optkit.model.state import eval_mode

    model = loaded.model
    kind = kind_of(model)
    try:
        inputs = example_inputs(model, input_shape)
        with eval_mode(model), torch.no_grad():
            inputs.call(model)
    except OptkitError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        shape = ",".join(map(str, input_shape))
        hint = (f"the shape comes from {origin}: override it with --input-shape (and --num-classes for another "
                "classifier size)" if origin else kind.shape_hint(model))
        raise OptkitError(f"the model does not run on input shape {shape} (kind {kind.name}: {first}); {hint}") from e


def data_normalization(pipeline: Pipeline) -> dict[str, dict[str, str]]:
    """The mean and std each image dataset spec the passes read normalizes with, by spec (for the report and ONNX
    metadata); text specs have none."""
    from optkit.data import dataset_info
    from optkit.data.specs import is_text

    return {spec: dataset_info(spec).normalization() for spec in _dataset_specs(pipeline) if not is_text(spec)}


def _dataset_specs(pipeline: Pipeline) -> list[str]:
    import dataclasses

    from optkit.core.contract import Pass
    from optkit.core.settings import declared

    specs: list[str] = []
    for step in pipeline.passes:
        if isinstance(step, Pass):
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
             on_pass: Callable[[int, int, str], None] | None = None, latency: bool | None = None,
             evaluation: EvalSettings | None = None, resume: bool = False, teacher=None,
             save_pt: bool = False) -> dict[str, Any]:
    """Run ``pipeline`` on a loaded model and write the result, ``recipe.toml``, ``report.json``, ``report.md``
    and ``channels.png`` (output channels per layer, before and after).

    The result is written once: a Hugging Face model whose stock class describes it is a ``save_pretrained``
    folder (config, safetensors in the model's dtype, sharded above :data:`optkit.io.hf.MAX_SHARD_SIZE` with
    its index, tokenizer); any other model, or with ``save_pt``, also (or only) ``model.pt``, the slimmed
    checkpoint. The report records each stage's peak memory (``memory``, and ``peak_rss_mb`` per pass).

    All files appear together at the end, or none do (a failure leaves
    ``out_dir`` as it was). In a distributed run only rank 0 writes. The passes
    get a :class:`~optkit.core.context.RunContext`: the output folder (training
    checkpoints), a staging folder for the files they publish, ``resume``, the
    ``teacher`` (default: a copy of the model before the passes, for the passes
    that distil), the process rank and the data's normalization. A pipeline with an
    ``export_onnx`` step writes a verified ``model.onnx`` (and ``model.int8.onnx``
    after an ``int8`` step); the report gets an ``export`` section with the
    compressed size of the weights before and after (and an ``int8`` section).
    With ``latency=True``, the model is also timed before and after the passes
    (PyTorch eager, where it lives). Unless ``latency=False``, a run that
    exports ONNX times the original and the result in ONNX Runtime, interleaved,
    at batch 1 with every core (:func:`onnx_latency`), and the report puts the
    realized speed-up next to the MACs ratio. With ``evaluation``, the original
    model and the result after every pass, the ONNX file and the INT8 file are
    scored on the same test samples, as the model's kind scores them (see
    :mod:`optkit.analysis.evaluation`).

    Returns:
        the report (as written to ``report.json``).

    Raises:
        OptkitError: for an unusable output folder, a model that does not run
            at the pipeline's input shape, or a failing pass (``PassError``,
            which wraps an ``ExportError`` when the exported model does not verify; nothing is written).
    """
    from optkit.runtime.distributed import launch_rank

    rank, world_size = launch_rank()
    main = rank == 0
    # Every file a run may write needs --force to replace: one this run does not
    # write is removed when its results are published (see StagedOutputs).
    created = main and not Path(out_dir).exists()
    out = prepare_output_dir(out_dir, RUN_FILES, force=force) if main else Path(out_dir)
    stages = StageMemory()
    # A run refused before it writes anything leaves no empty folder behind.
    with removed_if_left_empty(out, created=created):
        with stages("check"):
            check_runs(loaded, pipeline.input_shape, origin=pipeline.input_shape_origin)
            check_data(pipeline)
        scorer = None
        if evaluation is not None:
            with stages("evaluation: original"):
                scorer = Scorer(evaluation, loaded.model, pipeline.input_shape, source=loaded.source)
        exports = pipeline.writes_files()
        context = RunContext(out_dir=out, teacher=teacher, resume=resume, rank=rank, world_size=world_size,
                             data=data_normalization(pipeline))
        # Measured now: the passes change the model in place.
        with stages("inspect"):
            weights_before = weights_sizes(loaded.model) if exports and main else None
            channels = {"before": layer_channels(loaded.model)}
            before = {"dtype": weights_dtype(loaded.model), "input_size": input_size(loaded.source)}
        timings = None
        if latency:
            with stages("latency before (PyTorch)"):
                timings = {"before": time_model(loaded.model, pipeline.input_shape)}
        # The original's ONNX files live in a hidden folder of the output folder, removed however the run ends
        # (the next run removes one a SIGKILL left); only the main process of a run that exports writes them.
        exports_original = exports and latency is not False and main
        with scratch_folder(out, "original") if exports_original else contextlib.nullcontext() as scratch:
            original_onnx = None
            if exports_original:
                with stages("export original (ONNX, for latency)"):
                    original_onnx = _export_original(loaded.model, scratch, pipeline.input_shape)
            generation = None
            if latency is not False and main:
                with stages("generation before"):
                    generation = _generation_probe(loaded, scorer, scratch if original_onnx is not None else None)
            return _run_and_write(loaded, pipeline, context, on_pass=on_pass, scorer=scorer,
                                  weights_before=weights_before, channels=channels, timings=timings,
                                  original_onnx=original_onnx, generation=generation, stages=stages,
                                  before=before, save_pt=save_pt)


class StageMemory:
    """Peak memory and wall time of each stage of a run, for the report's ``memory`` section.

    ``with stages("name"):`` measures a block (see :class:`optkit.core.memory.PeakRss`).
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def __call__(self, stage: str):
        with PeakRss() as measured:
            yield
        self.rows.append({"stage": stage, **measured.to_dict()})

    def section(self) -> dict[str, Any]:
        """``{"method", "peak_rss_mb", "stages"}``: the process's peak RSS so far (the run's, loading included)
        and each stage's peak, start and end RSS (MiB), and seconds."""
        peaks = [row["peak_rss_mb"] for row in self.rows if row["peak_rss_mb"] is not None]
        if (mark := peak_rss()) is not None:
            peaks.append(round(mark / 2 ** 20, 1))
        return {"method": MEMORY_METHOD, "peak_rss_mb": max(peaks, default=None), "stages": list(self.rows)}


def weights_dtype(model) -> str | None:
    """The floating dtype of most of a model's parameters (``bfloat16``, ``float32``...), or ``None`` without any."""
    from collections import Counter

    counts: Counter = Counter()
    for parameter in checkpoint.unwrap(model).parameters():
        if parameter.is_floating_point():
            counts[str(parameter.dtype).removeprefix("torch.")] += parameter.numel()
    return counts.most_common(1)[0][0] if counts else None


def input_size(source: str | os.PathLike) -> int | None:
    """Bytes of the checkpoint a model was read from: the file, or a ``save_pretrained`` folder's safetensors."""
    from optkit.io import hf

    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    folder = hf.hf_folder(str(source)) if path.is_dir() or hf.is_hf_spec(source) else None
    sizes = [f.stat().st_size for f in folder.glob("*.safetensors")] if folder is not None else []
    return sum(sizes) if sizes else None


def _generation_probe(loaded: LoadedModel, scorer: Scorer | None, scratch: Path | None):
    """The decode speed and greedy sample of a causal LM before the passes (``None`` for other models: those
    whose kind is no language model, or that cannot generate).

    The prompt is the start of the first evaluation block when the run scores text, else the tokenizer's
    beginning-of-text token.
    """
    from optkit.analysis.evaluation import tokenizer_folders
    from optkit.analysis.generation import PROMPT_TOKENS, GenerationProbe
    from optkit.core.errors import DataError
    from optkit.data.text import find_tokenizer, load_tokenizer
    from optkit.export.decode import export_decode, unsupported
    from optkit.kinds import get_kind

    if not kind_of(loaded.model).language_model:
        return None
    model = checkpoint.unwrap(loaded.model)
    if unsupported(model) is not None:
        return None
    try:
        tokenizer = load_tokenizer(find_tokenizer(tokenizer_folders(model, loaded.source)))
    except DataError:
        tokenizer = None
    prompt = None
    if scorer is not None and get_kind(scorer.eval_set.kind).language_model:
        ids = scorer.eval_set.model_inputs().first()[0]
        prompt = ids[:PROMPT_TOKENS].tolist()
    probe = GenerationProbe.start(model, tokenizer=tokenizer, prompt=prompt)
    if probe is not None and scratch is not None:
        path = scratch / "original.decode.onnx"
        try:
            export_decode(model, path)
            probe.original_decode = path
        except OptkitError as e:
            probe.notes.append(f"decode in ONNX Runtime not timed: {e}")
    return probe


def _run_and_write(loaded: LoadedModel, pipeline: Pipeline, context: RunContext, *, on_pass, scorer: Scorer | None,
                   weights_before, channels: dict, timings: dict | None, original_onnx: Path | None,
                   generation=None, stages: StageMemory | None = None, before: dict | None = None,
                   save_pt: bool = False) -> dict[str, Any]:
    """Run the passes, then write every output together (see :func:`optimize`)."""
    out = context.out_dir
    stages = stages if stages is not None else StageMemory()
    after_pass = scorer.after_pass if scorer is not None else None
    if not context.is_main:
        run = pipeline.run(loaded.model, context=context, after_pass=after_pass)
        return build_report(run, model=loaded.source, input_shape=pipeline.input_shape)
    with contextlib.ExitStack() as stack:
        superseded = RUN_FILES + _old_shards(out)
        # Files the passes write (model.onnx) are staged from the start; without them the staging
        # folder appears only once the passes are done.
        early = (stack.enter_context(StagedOutputs(out, superseded=superseded))
                 if pipeline.writes_files() else None)
        context.files_dir = early.staging if early is not None else None
        with stages("passes"):
            full_run = pipeline.run(loaded.model, context=context, on_pass=on_pass, after_pass=after_pass)
        staged = early or stack.enter_context(StagedOutputs(out, superseded=superseded))
        run = full_run.torch_part()
        channels["after"] = layer_channels(checkpoint.unwrap(run.model))
        if timings is not None:
            with stages("latency after (PyTorch)"):
                timings["after"] = time_model(run.model, pipeline.input_shape)
        recipe_text = pipeline.to_toml()
        staged.path("recipe.toml").write_text(recipe_text, encoding="utf-8")
        files: dict[str, int] = {}
        with stages("save"):
            pretrained, pretrained_note = _write_pretrained(loaded, run.model, staged.staging, pipeline.input_shape)
            files.update({name: staged.path(name).stat().st_size for name in pretrained
                          if staged.path(name).is_file()})
            if save_pt or not pretrained:
                checkpoint.save(run.model, staged.path(CHECKPOINT_FILE), loaded.arch, extra={"recipe": recipe_text})
                files = {CHECKPOINT_FILE: staged.path(CHECKPOINT_FILE).stat().st_size, **files}
        exported = _file_sections(full_run, run.model, weights_before)
        for section in exported.values():
            files.update(section.get("files") or {section["path"]: section["file_size"]})
        files.update(_external_data(staged.staging, files))
        exported_file = next((Path(r.details["path"]) for r in full_run.records if r.name == "export_onnx"), None)
        onnx_timing = None
        if original_onnx is not None and exported_file is not None:
            with stages("latency (ONNX Runtime)"):
                onnx_timing = onnx_latency(original_onnx, exported_file, pipeline.input_shape,
                                           run.after.macs / run.before.macs if run.before.macs else None,
                                           kind=kind_of(loaded.model))
        report = build_report(run, model=loaded.source, input_shape=pipeline.input_shape, files=files,
                              channels=channels, input_file_size=(before or {}).get("input_size"),
                              latency=timings, onnx_latency=onnx_timing)
        report["file_size"]["after"] = _result_size(files)
        report["dtype"] = {"before": (before or {}).get("dtype"), "after": weights_dtype(run.model),
                           "on_disk": _dtype_on_disk(staged.staging, pretrained)}
        for key, section in exported.items():
            report[key] = section
            report["notes"].extend(section["notes"])
        if exported and (note := missing_openvino_note()) and note not in report["notes"]:
            report["notes"].append(note)
        if generation is not None:
            export_details = next((r.details for r in full_run.records if r.name == "export_onnx"), {})
            decode_file = (exported_file.with_name(export_details["decode"]["path"])
                           if "decode" in export_details else None)
            with stages("generation after"):
                report["generation"] = generation.finish(checkpoint.unwrap(run.model), decode_file)
        if scorer is not None:
            report["evaluation"] = scorer.section()
            if (accuracy := scorer.accuracy()) is not None:
                report["accuracy"] = accuracy
        if context.data:
            report["data"] = context.data
        if loaded.arch is None and CHECKPOINT_FILE in files:
            report["notes"].append("the input was a whole pickled module, so model.pt is one too: loading it needs --trust")
        report["notes"].extend(loaded.notes + ([pretrained_note] if pretrained_note else []))
        report["memory"] = stages.section()
        staged.path("report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        plot = CHANNELS_PLOT if plot_channels(report, staged.path(CHANNELS_PLOT)) else None
        staged.path("report.md").write_text(to_markdown(report, plot=plot), encoding="utf-8")
    if CHECKPOINT_FILE in files:
        _remember_architecture(loaded, out)
    return report


def _external_data(folder: Path, files: dict[str, int]) -> dict[str, int]:
    """Sizes of the ONNX files among ``files`` whose weights are in ``NAME.data`` beside them: the graph and
    the data file, each on its own."""
    sizes = {}
    for name in list(files):
        data = folder / f"{name}.data"
        if name.endswith(".onnx") and data.is_file() and (folder / name).is_file():
            sizes[name] = (folder / name).stat().st_size
            sizes[data.name] = data.stat().st_size
    return sizes


def _old_shards(out: Path) -> tuple[str, ...]:
    """The weight shards an earlier run's ``save_pretrained`` index in ``out`` lists (replaced with the index)."""
    from optkit.io.hf import SAFETENSORS_INDEX

    try:
        index = json.loads((Path(out) / SAFETENSORS_INDEX).read_text(encoding="utf-8"))
        return tuple(sorted({str(name) for name in index["weight_map"].values() if "/" not in str(name)}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()


def _result_size(files: dict[str, int]) -> int | None:
    """Bytes of the result's weights on disk: ``model.pt``, else the ``save_pretrained`` safetensors."""
    if CHECKPOINT_FILE in files:
        return files[CHECKPOINT_FILE]
    sizes = [size for name, size in files.items() if name.endswith(".safetensors")]
    return sum(sizes) if sizes else None


def _dtype_on_disk(folder: Path, written: list[str]) -> str | None:
    """The floating dtype most of the written safetensors' weights are stored in (read from their headers)."""
    from collections import Counter

    counts: Counter = Counter()
    for name in written:
        if not name.endswith(".safetensors"):
            continue
        with open(folder / name, "rb") as f:
            header = safetensors_header(f)
        for key, entry in header.items():
            if key != "__metadata__" and entry["dtype"] in SAFETENSORS_FLOATS:
                shape = entry["shape"]
                counts[SAFETENSORS_FLOATS[entry["dtype"]]] += math.prod(shape) if shape else 1
    return counts.most_common(1)[0][0] if counts else None


#: safetensors' floating dtype names, as torch names them.
SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _write_pretrained(loaded: LoadedModel, model, folder: Path,
                      input_shape: tuple[int, ...]) -> tuple[list[str], str | None]:
    """A ``transformers`` model is written as a ``save_pretrained`` folder (config, safetensors, tokenizer)."""
    from optkit.io import hf
    from optkit.kinds import example_inputs, is_hf_pretrained

    model = checkpoint.unwrap(model)
    if not is_hf_pretrained(model):
        return [], None
    source = hf.hf_folder(loaded.source) if loaded.arch is not None and hf.is_hf_spec(loaded.arch.spec) else None
    inputs = example_inputs(model, input_shape)
    check = inputs.kwargs if inputs.kwargs and not inputs.args else None
    return hf.save_pretrained_folder(model, folder, source=source, check_inputs=check)


def _file_sections(run, model, weights_before: dict[str, int] | None) -> dict[str, dict[str, Any]]:
    """The report sections of the steps that wrote files, by report key (``export``, ``int8``, else the step's name)."""
    sections = {}
    for record in run.records:
        if record.form == TORCH:
            continue
        if record.name == "export_onnx":
            sections["export"] = _export_section(record.details, model, weights_before)
        else:
            sections[record.name] = {**record.details, "path": Path(record.details["path"]).name}
    return sections


class Scorer:
    """Scores the original model and each stage's result on the same test samples, for the report.

    The model's kind reads the samples and scores them (see :mod:`optkit.analysis.evaluation`);
    ``source`` is the model spec, where a language model's tokenizer is found. The original is run once,
    here, and only what the comparisons need is kept (:func:`optkit.analysis.evaluation.reference`: a
    language model's top tokens per position, never every logit, and no copy of the model); each stage is
    then run a batch at a time and scored as it goes.
    """

    def __init__(self, settings: EvalSettings, model, input_shape: tuple[int, ...], *, source: str | None = None):
        from optkit.analysis import evaluation

        self.settings = settings
        self.eval_set = evaluation.load_eval_set(settings, model, input_shape, source=source)
        with eval_progress("evaluation: original"):
            self.reference = evaluation.reference(model, self.eval_set, settings.batch_size)
        self.stages = [{"stage": "original", **evaluation.score(self.reference, self.eval_set)}]

    def after_pass(self, record, model) -> None:
        """Score the model after a pass (a ``Pipeline.run`` ``after_pass`` hook); a file form in ONNX Runtime."""
        from optkit.analysis import evaluation

        if record.form != TORCH:
            # A step that writes files beside the ONNX model (openvino) returns the file already scored.
            if not any(stage["stage"] == f"{Path(model.path).name} (ONNX Runtime)" for stage in self.stages):
                self.score_onnx(Path(model.path).name, Path(model.path))
            return
        with eval_progress(f"evaluation: after {record.name}"):
            scores = evaluation.score_model(model, self.eval_set, self.settings.batch_size, self.reference)
        self.stages.append({"stage": f"after {record.name}", **scores})

    def score_onnx(self, name: str, path: Path) -> None:
        """Score an exported file in ONNX Runtime."""
        from optkit.analysis import evaluation

        with eval_progress(f"evaluation: {name}"):
            scores = evaluation.score_model(path, self.eval_set, self.settings.batch_size, self.reference)
        self.stages.append({"stage": f"{name} (ONNX Runtime)", **scores})

    def section(self) -> dict[str, Any]:
        """The report's ``evaluation`` section: the data, what one sample is, the kind's score columns and the stages."""
        from optkit.analysis.evaluation import score_columns

        section = {"data": self.eval_set.spec, "split": "test", "samples": len(self.eval_set),
                   "unit": self.eval_set.unit, "columns": score_columns(self.eval_set), "stages": self.stages}
        top_k, vocabulary = getattr(self.reference, "top_k", None), getattr(self.reference, "vocabulary", None)
        if top_k is not None and vocabulary is not None and top_k < vocabulary:
            section["kl_top_k"] = top_k
        return section

    def accuracy(self) -> dict[str, Any] | None:
        """The report's ``accuracy``: the original and the result on the same test samples
        (``None`` when the kind's scores have no accuracy).

        It replaces the fine-tune pass's validation accuracy, which is measured on other images and
        has no "before".
        """
        if self.stages[0].get("accuracy") is None:  # a kind without an accuracy figure (a detector's mAP)
            return None
        torch_stages = [stage for stage in self.stages if not stage["stage"].endswith("(ONNX Runtime)")]
        return {"before": self.stages[0]["accuracy"], "after": torch_stages[-1]["accuracy"],
                "dataset": f"the first {len(self.eval_set):,} test {self.eval_set.unit} of {self.eval_set.spec}"}


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
                 kind: ModelKind | None = None, threads: int | None = None, warmup: int = 5,
                 repeats: int = 30) -> dict[str, Any]:
    """ONNX Runtime latency of the original and the result at batch 1, interleaved, and the realized speed-up.

    Args:
        original, result: the two ONNX files.
        input_shape: the model input; timed at batch 1.
        macs_ratio: MACs after / before, for the speed-up the MACs promise.
        kind: the model's kind, which says what one call at batch 1 processes (for the report's throughput).
        threads: intra-op threads (default: every core, as users deploy).
        warmup, repeats: untimed and timed calls of each file.

    When the original takes under :data:`OVERHEAD_BOUND_MS` per call and both files take any batch,
    the two are also timed at the power-of-two batch (at most :data:`MAX_COMPUTE_BATCH`) where the
    original takes about :data:`COMPUTE_MS`: at batch 1 such a model's time is largely ONNX Runtime's
    fixed cost per call, which pruning cannot remove.

    Returns:
        ``threads``, ``batch_size``, the two :class:`Latency` dicts, ``speedup`` (original / result
        median), ``ideal_speedup`` (1 / MACs ratio), ``efficiency`` (their ratio) and the load average;
        ``at_batch`` holds the same figures at the larger batch when it was timed, and ``throughput``
        (:meth:`ModelKind.throughput` at batch 1, as a dict) what one call processes, given ``kind``.
    """
    from optkit.analysis.latency import interleaved_latency

    threads = threads or os.cpu_count() or 1
    ideal = 1 / macs_ratio if macs_ratio else None

    def timed(batch: int) -> dict[str, Any]:
        # Retried once when the machine was loaded or noisy; a timing still so carries its flag to the report.
        before, after = interleaved_latency([original, result], (batch, *input_shape[1:]), threads=threads,
                                            warmup=warmup, repeats=repeats, retries=1)
        speedup = before.median_ms / after.median_ms if after.median_ms else float("inf")
        return {"batch_size": batch, "before": before.to_dict(), "after": after.to_dict(),
                "speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3) if ideal else None,
                "efficiency": round(speedup / ideal, 3) if ideal else None}

    timing = {"engine": "onnxruntime", "threads": threads, **timed(1)}
    if kind is not None:
        timing["throughput"] = dataclasses.asdict(kind.throughput((1, *input_shape[1:])))
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
    from optkit.kinds import model_device

    (result,) = bench_torch(model, input_shape, device=str(model_device(model)), warmup=3, repeats=20, retries=1)
    return {k: v for k, v in result.to_dict().items()
            if k in ("engine", "device", "threads", "median_ms", "p90_ms", "spread", "repeats", "conditions")}


def verification_text(checks: list[dict[str, Any]], separator: str = "; ") -> str:
    """How an export was verified, per batch: ``batch 1: max |diff| ... <= ...; batch 3: ...``. A file with a fixed
    batch (a detector's, which takes a fixed number of images) is checked twice at that batch on different
    inputs, and the text says so instead of repeating the batch."""
    sizes = [c["batch_size"] for c in checks]
    if len(set(sizes)) == 1 and len(sizes) > 1:
        diffs = ", ".join(f"{c['max_abs_diff']:.2g} <= {c['tolerance']:.2g}" for c in checks)
        return f"batch {sizes[0]} (the file takes a fixed batch) on {len(sizes)} random inputs: max |diff| {diffs}"
    return separator.join(f"batch {c['batch_size']}: max |diff| {c['max_abs_diff']:.2g} <= {c['tolerance']:.2g}"
                          for c in checks)


def decode_note(decode: dict[str, Any]) -> str:
    """One line on the decode-step graph an export wrote beside ``model.onnx``."""
    checks = "; ".join(f"{new} new on {past} cached tokens: max |diff| {diff:.2g} <= {tolerance:.2g}"
                       for new, past, diff, tolerance in decode["checks"])
    return (f"{decode['path']}: one step with a KV cache over {decode['layers']} layers (a prefill or a decode step; "
            f"generates text in ONNX Runtime), verified against PyTorch ({checks})")


def _export_section(details: dict[str, Any], model, weights_before: dict[str, int]) -> dict[str, Any]:
    """The report's ``export`` section: what ``export_onnx`` wrote, with weight sizes before and after the passes."""
    result = dict(details)
    result["path"] = os.path.basename(result["path"])
    after = weights_sizes(model)
    result["weights_before"], result["weights_after"] = weights_before, after
    checks = verification_text(result["verification"])
    result["notes"] = [f"model.onnx: {result['exporter']} exporter, opset {result['opset']}, verified against PyTorch "
                       f"in ONNX Runtime ({checks})",
                       f"weights: {weights_before['weights']:,} -> {after['weights']:,} bytes raw, "
                       f"{weights_before['weights_gzip']:,} -> {after['weights_gzip']:,} bytes gzipped",
                       *([decode_note(result["decode"])] if "decode" in result else []), *result["notes"]]
    return result
