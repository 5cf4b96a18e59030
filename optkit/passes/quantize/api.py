"""``quantize_onnx``: an exported FP32 ONNX model to a verified INT8 one.

Steps: load the calibration and checking images (refusing early when there are
none), pre-process the graph, leave in FP32 the op groups whose INT8 kernels
are slower on this machine (:mod:`optkit.passes.quantize.optypes`), quantize,
check agreement and accuracy against the FP32 model
(:mod:`optkit.passes.quantize.verify`), and when a threshold is missed leave
the most harmful layers in FP32 one at a time
(:mod:`optkit.passes.quantize.exclusion`). Only a model that passes is moved
into place; on any failure nothing is written.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optkit.core.errors import DataError, ExportError
from optkit.core.settings import check_input_shape
from optkit.passes.quantize import exclusion, optypes, profile, static, verify
from optkit.passes.quantize.calibration import NO_DATA, Batches, load_batches
from optkit.passes.quantize.settings import Int8Settings

RANDOM_NOTE = ("random calibration: activation ranges were set on random inputs, not images, so the INT8 model "
               "is fit for timing only; its agreement was checked on random inputs and its accuracy is unknown")
TRIVIAL_NOTE = ("the FP32 model's outputs are all near zero (max |output| {largest:.3g}), so agreement could not "
                "tell a broken INT8 model from a good one: check again with trained weights")


@dataclass
class QuantizeResult:
    """What :func:`quantize_onnx` wrote and how it was checked.

    Attributes:
        path: the INT8 ONNX file.
        mode: ``static`` or ``dynamic``.
        calibration_method: ``minmax``, ``entropy`` or ``percentile`` (``None`` in dynamic mode).
        calibration: where the calibration inputs came from (``None`` in dynamic mode).
        checked_on: where the checking inputs came from.
        fp32_size, int8_size: file sizes in bytes.
        agreement: top-1 agreement with the FP32 model on the checking inputs.
        relative_error: ``||int8 - fp32|| / ||fp32||`` of the outputs.
        accuracy_fp32, accuracy_int8: accuracy when the inputs have labels, else ``None``.
        samples: checking inputs.
        excluded_nodes: nodes the exclusion search left in FP32, in the order it chose them.
        user_excluded: nodes left in FP32 because the settings said so.
        fp32_op_types: op groups left in FP32 because their INT8 kernels measured slower here.
        fp32_nodes: nodes of the INT8 op groups left in FP32 because their INT8 kernels measured slower here.
        op_gains: per op group, time before / time after quantizing it, groups added one at a time heaviest
            first (below 0.95: INT8 was slower); ``all``: the choice's time / the fully quantized model's;
            ``nodes``: the time before / after ``fp32_nodes`` were left in FP32, when some were tried.
        op_gains_cached: whether ``op_gains`` came from the per-machine cache.
        quantized_nodes: nodes quantized in the written model.
        search: the exclusion search's steps (node, score, check after it).
        seconds: wall time.
        notes: plain-language remarks for the report (``random calibration`` when it was used).
    """

    path: str
    mode: str
    calibration_method: str | None
    calibration: str | None
    checked_on: str
    fp32_size: int
    int8_size: int
    agreement: float
    relative_error: float
    accuracy_fp32: float | None
    accuracy_int8: float | None
    samples: int
    excluded_nodes: list[str]
    user_excluded: list[str]
    fp32_op_types: list[str]
    fp32_nodes: list[str]
    op_gains: dict[str, float]
    op_gains_cached: bool
    quantized_nodes: int
    search: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantize_onnx(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, settings: Int8Settings | None = None,
                  *, input_shape: Sequence[int], eval_data: str | None = None, timer: optypes.Timer | None = None,
                  profiler: optypes.Profiler | None = None,
                  cache_path: str | os.PathLike | None = None) -> QuantizeResult:
    """Quantize an FP32 ONNX file to INT8, verified on the task before it is written.

    Args:
        fp32_path: the FP32 model (from :func:`optkit.export.onnx.export_onnx`).
        int8_path: destination; written only when the INT8 model passes.
        settings: the :class:`Int8Settings` (defaults when ``None``).
        input_shape: the model input shape, batch first, e.g. ``(1, 3, 224, 224)``.
        eval_data: dataset spec whose ``val`` split checks the INT8 model (default: the calibration spec's).
        timer: times ONNX files interleaved, returning median milliseconds (default: ONNX Runtime at
            ``settings.timing_threads`` threads, batch 1); tests inject one so they never time anything.
        profiler: gives each node's kernel time in an ONNX file, keyed by the FP32 node names (default:
            ONNX Runtime's profiler at ``settings.timing_threads`` threads, batch 1); tests inject one.
        cache_path: the per-machine op-speed cache (default :func:`optkit.passes.quantize.optypes.default_cache_path`).

    Returns:
        the :class:`QuantizeResult`.

    Raises:
        ValueError: for a bad ``input_shape``.
        DataError: with no calibration data (and no ``random_calibration``), an empty split, or images that do
            not fit the model.
        ExportError: if ONNX Runtime cannot quantize the model, or the INT8 model misses a threshold even with
            ``max_excluded`` layers in FP32 (nothing is written then).
    """
    start = time.perf_counter()
    settings = settings or Int8Settings()
    shape = check_input_shape(input_shape)
    source = Path(fp32_path)
    if not source.is_file():
        raise ExportError(f"{source} not found; export the model first (optkit export MODEL --onnx {source})")
    shape, fixed_batch = _fit_shape(source, shape)
    batch = shape[0] if fixed_batch else settings.batch_size
    calibration = None
    if settings.mode == "static":
        calibration = load_batches(settings.calib_data, "train", shape, batch_size=batch,
                                   samples=settings.calibration_batches * batch,
                                   random=settings.random_calibration, seed=settings.seed)
    check_spec = eval_data or settings.calib_data
    if check_spec is None and not settings.random_calibration:
        raise DataError(NO_DATA)
    checking = load_batches(check_spec, "val", shape, batch_size=batch, samples=settings.eval_samples,
                            random=check_spec is None, seed=settings.seed + 1)
    wider = None if check_spec is None else verify.wider_batches(check_spec, shape, batch, settings.eval_samples,
                                                                 settings.seed + 1)
    target = Path(int8_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".int8", dir=target.parent))
    try:
        return _run(source, target, scratch, settings, shape, calibration, checking, wider, timer, profiler,
                    cache_path, start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(source: Path, target: Path, scratch: Path, settings: Int8Settings, shape: tuple[int, ...],
         calibration: Batches | None, checking: Batches, wider: Callable[[], Batches] | None,
         timer: optypes.Timer | None, profiler: optypes.Profiler | None, cache_path: str | os.PathLike | None,
         start: float) -> QuantizeResult:
    op_types = set(settings.op_types) or static.supported_op_types(settings.mode)
    pre, groups, known = prepare(source, scratch, op_types, settings.exclude)
    counter = itertools.count()

    def build(excluded: Collection[str]) -> Path:
        out = scratch / f"int8-{next(counter)}.onnx"
        static.quantize_file(pre, out, mode=settings.mode, method=settings.calibration_method,
                             per_channel=settings.per_channel, op_types=sorted(op_types),
                             exclude=sorted(set(settings.exclude) | set(excluded)), calibration=calibration,
                             cache_path=scratch / "calibration.json")
        return out

    gains, slow, slow_nodes, cached = _op_verdict(pre, groups, build, settings, shape, timer, profiler, cache_path)
    if slow and not set(groups) - set(slow) - exclusion.NOT_SEARCHED:
        raise ExportError(f"INT8 ran slower than FP32 here for every op group that computes ({_gains_words(gains)}); "
                          "nothing was written: keep the FP32 model, or set measure_ops = false to quantize anyway")
    fixed = [node for group in slow for node in groups[group]] + slow_nodes
    reference = verify.outputs(pre, checking, threads=_threads())

    @functools.cache
    def more() -> tuple[Batches, Any]:
        batches = wider()
        return batches, verify.outputs(pre, batches, threads=_threads())

    def compared(path: Path, batches: Batches, fp32) -> verify.Agreement:
        return verify.agreement(fp32, verify.outputs(path, batches, threads=_threads()), _labels(batches))

    def check(path: Path) -> tuple[verify.Agreement, list[str]]:
        return verify.decided(compared(path, checking, reference), settings.min_agreement, settings.max_accuracy_drop,
                              None if wider is None else lambda: compared(path, *more()))

    candidates = {n for group, names in groups.items() if group not in exclusion.NOT_SEARCHED
                  for n in names} - set(settings.exclude) - set(fixed)

    def rank(path: Path, excluded: list[str]) -> list[tuple[str, float]]:
        import numpy as np

        return exclusion.node_scores(pre, path, [np.concatenate(checking.inputs)], candidates - set(excluded), scratch)

    first_path = build(fixed)
    first = (first_path, *check(first_path))
    limit = settings.max_excluded if settings.auto_exclude else 0
    outcome = exclusion.search(lambda extra: build(fixed + extra), check, rank, max_excluded=limit, first=first)
    if outcome.missed:
        tried = (f" even with {len(outcome.excluded)} layer(s) left in FP32 ({', '.join(outcome.excluded)})"
                 if outcome.excluded else "")
        raise ExportError(f"the INT8 model missed the threshold on "
                          f"{verify.checked_on(checking, outcome.result.samples)}{tried}: "
                          f"{'; '.join(outcome.missed)}; nothing was written (lower --min-agreement, raise "
                          "--max-accuracy-drop or --max-excluded, or keep the FP32 model)")
    quantized = len(int8_nodes(outcome.path, {n for nodes in groups.values() for n in nodes}))
    publish(outcome.path, target)
    return _result(source, target, settings, calibration, checking, outcome, slow, slow_nodes, gains, cached,
                   reference, quantized, time.perf_counter() - start)


def _op_verdict(pre: Path, groups: dict[str, list[str]], build, settings: Int8Settings, shape: tuple[int, ...],
                timer: optypes.Timer | None, profiler: optypes.Profiler | None,
                cache_path) -> tuple[dict[str, float], list[str], list[str], bool]:
    """``(gains, groups left in FP32, nodes left in FP32, whether it came from the cache)``."""
    if not settings.measure_ops:
        return {}, [], [], False
    cache = optypes.GainCache(cache_path or optypes.default_cache_path())
    machine, digest = optypes.machine_key(settings.timing_threads), optypes.graph_digest(pre)
    found = cache.get(machine, digest)
    if found is not None and set(found[0]) - {"all", "nodes"} == set(groups):
        return (*found, True)
    timer = timer or _default_timer(shape, settings.timing_threads)
    gains, slow = optypes.measure_gains(pre, groups, build, timer)
    computing = [group for group in groups if group not in set(slow) | exclusion.NOT_SEARCHED]
    slow_nodes: list[str] = []
    if computing:
        fixed = [node for group in slow for node in groups[group]] + list(settings.exclude)
        if profiler is None:
            nodes = [node for group in computing for node in groups[group]]
            profiler = _default_profiler(pre, nodes, shape, settings.timing_threads)
        slow_nodes, gain = optypes.slow_nodes(pre, build(fixed), fixed, build, timer, profiler)
        if gain is not None:
            gains["nodes"] = gain
    cache.put(machine, digest, gains, slow, slow_nodes)
    return gains, slow, slow_nodes, False


def _gains_words(gains: dict[str, float]) -> str:
    return ", ".join(f"{group} {gain:.2f}x" for group, gain in gains.items())


def _default_timer(shape: tuple[int, ...], threads: int) -> optypes.Timer:
    from optkit.analysis.latency import interleaved_latency

    def timer(paths: Sequence[Path]) -> list[float]:
        return [r.median_ms for r in interleaved_latency(paths, (1, *shape[1:]), threads=threads, warmup=3,
                                                         repeats=15)]

    return timer


def _default_profiler(pre: Path, nodes: list[str], shape: tuple[int, ...], threads: int) -> optypes.Profiler:
    def profiler(path: Path) -> dict[str, float]:
        return profile.node_times(path, pre, nodes, (1, *shape[1:]), threads=threads)

    return profiler


def _fit_shape(path: Path, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """``shape`` checked against the file's declared input (a fixed batch replaces the given one), and whether
    the batch is fixed.

    Raises:
        DataError: if the file declares other sizes.
    """
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    name = static.input_name(path)
    dims = [d.dim_value if d.HasField("dim_value") else None
            for d in next(i for i in graph.input if i.name == name).type.tensor_type.shape.dim]
    if not dims:
        return shape, False
    declared = tuple(d or "?" for d in dims)
    if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims[1:], shape[1:])):
        raise DataError(f"{path} takes input {declared} but input_shape is {shape}; "
                        "set --input-shape to the model's input")
    return ((dims[0], *shape[1:]), True) if dims[0] else (shape, False)


def prepare(source: Path, scratch: Path, op_types: Collection[str], exclude: Collection[str],
            ) -> tuple[Path, dict[str, list[str]], set[str]]:
    """The pre-processed FP32 file in ``scratch``, its quantizable nodes by op group, and all their names.

    Raises:
        ExportError: when no node has the op types, or ``exclude`` names a node that is not one of them.
    """
    pre = scratch / "fp32.onnx"
    static.preprocess(source, pre)
    groups = optypes.op_groups(pre, op_types)
    known = {n for names in groups.values() for n in names}
    if not known:
        raise ExportError(f"{source} has no named nodes of the op types to quantize ({', '.join(sorted(op_types))}); "
                          "nothing would be INT8")
    unknown = sorted(set(exclude) - known)
    if unknown:
        raise ExportError(f"exclude names {', '.join(unknown)}, not a node of the op types quantized here; "
                          f"use node names from the ONNX graph, e.g. {', '.join(sorted(known)[:3])}")
    return pre, groups, known


def int8_nodes(path: str | os.PathLike, names: Collection[str]) -> set[str]:
    """The nodes among ``names`` (of the FP32 graph) that run in INT8 in the file ``path``: replaced by integer
    ops (dynamic), or reading a dequantized input (QDQ)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    present = {n.name: n for n in graph.node}
    return {name for name in names if name not in present or any(i in dequantized for i in present[name].input)}


def _labels(batches: Batches):
    import numpy as np

    return None if batches.labels is None else np.concatenate(batches.labels)


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def publish(path: Path, target: Path) -> None:
    """Move a checked file from the scratch folder into place, flushed to disk first."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(path, target)


def _result(source: Path, target: Path, settings: Int8Settings, calibration: Batches | None, checking: Batches,
            outcome: exclusion.SearchOutcome, slow: list[str], slow_nodes: list[str], gains: dict[str, float],
            cached: bool, reference, quantized: int, seconds: float) -> QuantizeResult:
    r = outcome.result
    notes = [static.REDUCED_RANGE_NOTE] if static.int8_can_saturate() else []
    if settings.random_calibration:
        notes.append(RANDOM_NOTE)
    largest = float(abs(reference).max()) if reference.size else 0.0
    if largest < 1e-6:
        notes.append(TRIVIAL_NOTE.format(largest=largest))
    if slow:
        notes.append(f"kept in FP32 because quantizing them measured slower here: {', '.join(slow)} "
                     f"({_gains_words({g: gains[g] for g in slow})} the speed before)")
    elif "all" in gains:
        notes.append("every op group is INT8: some measured slower one at a time, but the fully quantized model "
                     f"ran {gains['all']:.2f}x faster than the choice without them")
    if slow_nodes:
        notes.append(f"{len(slow_nodes)} node(s) kept in FP32 because their INT8 kernels measured slower here "
                     f"(the model ran {gains['nodes']:.2f}x faster with them in FP32): {', '.join(slow_nodes)}")
    if outcome.excluded:
        notes.append(f"the exclusion search left {len(outcome.excluded)} layer(s) in FP32 to meet the thresholds: "
                     f"{', '.join(outcome.excluded)}")
    static_mode = settings.mode == "static"
    return QuantizeResult(
        str(target), settings.mode, settings.calibration_method if static_mode else None,
        calibration.source if calibration is not None else None, checking.source, source.stat().st_size,
        target.stat().st_size, r.agreement, r.relative_error, r.accuracy_fp32, r.accuracy_int8, r.samples,
        list(outcome.excluded), list(settings.exclude), slow, slow_nodes, gains, cached, quantized,
        [asdict(step) for step in outcome.steps], round(seconds, 3), notes)
