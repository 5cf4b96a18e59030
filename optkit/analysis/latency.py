"""Latency measurement: PyTorch eager, ONNX Runtime and OpenVINO, with the noise reported.

Each measurement runs a few untimed warm-up calls, then times ``repeats``
calls one by one (:func:`optkit.analysis.metrics.time_callable`) and reports the
median, the 90th percentile and their ratio (``spread``): a spread well above
1 means the machine was noisy and small differences mean nothing. A file is
timed in the runtime it is deployed with: an ONNX file in ONNX Runtime (or in
OpenVINO when asked), an OpenVINO IR (``.xml``) in OpenVINO at the precision it
records (:mod:`optkit.export.openvino`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError

if TYPE_CHECKING:
    from torch import nn

ENGINES = ("torch", "onnxruntime", "openvino")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor or machine name elsewhere)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            found = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        found = None
    return found or platform.processor() or platform.machine()


@dataclass
class Latency:
    """One latency measurement.

    Attributes:
        engine: ``torch`` (eager), ``onnxruntime`` or ``openvino``.
        device: where it ran (``cpu``, ``cuda``).
        batch_size: inputs per call.
        input_shape: the full input shape of one call.
        threads: intra-op threads used (``None``: the engine's default).
        median_ms, p90_ms, min_ms, max_ms: latency of one call in milliseconds.
        spread: ``p90_ms / median_ms`` (1.0 means no noise).
        repeats: timed calls; warmup: untimed calls before them.
        throughput: inputs per second at the median latency.
        precision: what the file computes in, when known (``fp32``, ``bf16``, ``int8``).
    """

    engine: str
    device: str
    batch_size: int
    input_shape: tuple[int, ...]
    threads: int | None
    median_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    spread: float
    repeats: int
    warmup: int
    throughput: float
    precision: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        return out


def _latency(engine: str, device: str, shape: tuple[int, ...], threads: int | None, timing: dict[str, float],
             warmup: int, precision: str | None = None) -> Latency:
    median = timing["median_ms"]
    return Latency(engine, device, shape[0], shape, threads, median, timing["p90_ms"], timing["min_ms"],
                   timing["max_ms"], timing["spread"], int(timing["repeats"]), warmup,
                   shape[0] * 1000.0 / median if median else 0.0, precision)


@dataclass(frozen=True)
class Deployment:
    """A file as it is deployed: the runtime that runs it and the precision it computes in.

    Attributes:
        path: an ONNX file, or an OpenVINO IR ``.xml``.
        runtime: ``onnxruntime`` or ``openvino`` (which also reads ONNX files).
        precision: OpenVINO's precision (``fp32``, ``bf16``, ``int8``; ``None``: the one the file records, else
            ``fp32``); for ONNX Runtime, a label for the report (the file fixes what it computes in).
    """

    path: str | os.PathLike
    runtime: str = "onnxruntime"
    precision: str | None = None


def as_deployment(target: str | os.PathLike | Deployment) -> Deployment:
    """``target`` as a :class:`Deployment`: a ``.xml`` file runs in OpenVINO, any other file in ONNX Runtime."""
    if isinstance(target, Deployment):
        return target
    return Deployment(target, "openvino" if is_openvino(target) else "onnxruntime")


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")


def bench_torch(model: nn.Module, input_shape: Sequence[int], *, batch_sizes: Sequence[int] | None = None,
                threads: int | None = None, device: str = "cpu", warmup: int = 5, repeats: int = 30) -> list[Latency]:
    """Time eager PyTorch inference (``eval`` mode, ``no_grad``).

    Args:
        model: the model; it is moved to ``device`` and timed in eval mode
            (its train/eval mode is restored afterwards).
        input_shape: one input's shape; its first entry is the batch size used
            when ``batch_sizes`` is not given.
        batch_sizes: batch sizes to time, each replacing ``input_shape[0]``.
        threads: intra-op threads (``torch.set_num_threads``) while timing;
            ``None`` keeps torch's current setting. Restored afterwards.
        device: ``cpu`` or ``cuda`` (CUDA calls are synchronized before the clock stops).
        warmup: untimed calls before timing each batch size.
        repeats: timed calls per batch size.

    Returns:
        one :class:`Latency` per batch size.

    Raises:
        OptkitError: if the model does not run at a shape, or the device is unavailable.
    """
    import torch

    from optkit.analysis.metrics import time_callable

    _check_counts(warmup, repeats)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OptkitError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    was_training = model.training
    model = model.to(device).eval()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    results = []
    try:
        for shape in _shapes(input_shape, batch_sizes):
            inputs = _example_inputs(model, shape)

            def call() -> None:
                with torch.no_grad():
                    inputs.call(model)
                sync()

            try:
                timing = time_callable(call, warmup=warmup, repeats=repeats)
            except Exception as e:
                raise OptkitError(f"the model does not run on input shape {','.join(map(str, shape))} ({e}); "
                                  "set --input-shape to what it expects") from e
            results.append(_latency("torch", str(device), shape, used_threads, timing, warmup))
    finally:
        torch.set_num_threads(previous_threads)
        model.train(was_training)
    return results


def _example_inputs(model: nn.Module, shape: tuple[int, ...]) -> Any:
    from optkit.kinds import example_inputs

    try:
        return example_inputs(model, shape)
    except OptkitError as e:
        raise OptkitError(f"the model does not take input shape {','.join(map(str, shape))}: {e}") from e


def bench_onnx(path: str | os.PathLike, input_shape: Sequence[int] | None = None, *,
               batch_sizes: Sequence[int] | None = None, threads: int | None = None, device: str = "cpu",
               warmup: int = 5, repeats: int = 30) -> list[Latency]:
    """Time an ONNX file in ONNX Runtime.

    Args:
        path: the ``.onnx`` file.
        input_shape: one input's shape; by default the file's declared input
            shape, which must be static apart from the batch (a symbolic
            batch runs at 1 unless ``batch_sizes`` says otherwise).
        batch_sizes: batch sizes to time; a file with a fixed batch runs only at that batch.
        threads: ONNX Runtime intra-op threads (``None``: its default).
        device: ``cpu``, or ``cuda`` to use the CUDA execution provider.
        warmup: untimed calls before timing each batch size.
        repeats: timed calls per batch size.

    Returns:
        one :class:`Latency` per batch size.

    Raises:
        OptkitError: if the file cannot be loaded, its shape is unknown, or it fails to run.
    """
    import onnxruntime as ort

    from optkit.analysis.metrics import time_callable

    _check_counts(warmup, repeats)
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise OptkitError("ONNX Runtime here has no CUDA execution provider; use --device cpu or install onnxruntime-gpu")
        providers.insert(0, "CUDAExecutionProvider")
    try:
        session = ort.InferenceSession(os.fspath(path), options, providers=providers)
    except Exception as e:
        raise OptkitError(f"{path}: ONNX Runtime cannot load it ({e})") from e
    inputs = session.get_inputs()
    declared = inputs[0].shape
    shape = tuple(input_shape) if input_shape is not None else _static_shape(path, declared, batch_sizes)
    results = []
    for run_shape in _shapes(shape, batch_sizes):
        if len(declared) == len(run_shape) and isinstance(declared[0], int) and declared[0] != run_shape[0]:
            raise OptkitError(f"{path} was exported with a fixed batch of {declared[0]}; "
                              f"it cannot run batch {run_shape[0]} (export with a dynamic batch)")
        feed = onnx_feed(session, run_shape)
        try:
            timing = time_callable(lambda: session.run(None, feed), warmup=warmup, repeats=repeats)
        except Exception as e:
            raise OptkitError(f"{path} does not run on input shape {','.join(map(str, run_shape))} ({e})") from e
        results.append(_latency("onnxruntime", device, run_shape, threads, timing, warmup))
    return results


def bench_exported(model: nn.Module, input_shape: Sequence[int], *, batch_sizes: Sequence[int] | None = None,
                   threads: int | None = None, device: str = "cpu", warmup: int = 5, repeats: int = 30,
                   engine: str = "onnxruntime", precision: str | None = None) -> list[Latency]:
    """Time a PyTorch model in ONNX Runtime or OpenVINO: export it to a temporary ONNX file, then time that file.

    The export is :func:`optkit.export.onnx.export_onnx` with a dynamic batch, so
    the file is verified against PyTorch before it is timed. The other arguments
    are those of :func:`bench_torch`, and ``precision`` that of :func:`bench_openvino`.

    Args:
        engine: ``onnxruntime`` (:func:`bench_onnx`) or ``openvino`` (:func:`bench_openvino`, CPU only).

    Raises:
        OptkitError: if optkit's exporter is not installed, or export or timing fails.
    """
    import tempfile

    try:
        from optkit.export.onnx import export_onnx
    except ImportError as e:
        raise OptkitError("timing a PyTorch model in ONNX Runtime needs optkit.export.onnx, which this installation "
                          "lacks; export the model to .onnx and bench that file") from e
    shape = tuple(int(v) for v in input_shape)
    with tempfile.TemporaryDirectory(prefix="optkit-bench-") as folder:
        path = os.path.join(folder, "model.onnx")
        export_onnx(model, path, shape, dynamic_batch=True)
        if engine == "openvino":
            return bench_openvino(path, shape, batch_sizes=batch_sizes, threads=threads, precision=precision,
                                  warmup=warmup, repeats=repeats)
        return bench_onnx(path, shape, batch_sizes=batch_sizes, threads=threads, device=device,
                          warmup=warmup, repeats=repeats)


def bench_openvino(path: str | os.PathLike, input_shape: Sequence[int] | None = None, *,
                   batch_sizes: Sequence[int] | None = None, threads: int | None = None,
                   precision: str | None = None, warmup: int = 5, repeats: int = 30) -> list[Latency]:
    """Time an OpenVINO IR (``.xml``) or an ONNX file in OpenVINO on the CPU.

    Each batch size is compiled for that fixed input shape (see :func:`optkit.export.openvino.compile_model`).

    Args:
        path: the ``.xml`` (its ``.bin`` beside it) or ``.onnx`` file.
        input_shape: one input's shape; by default the file's declared shape, which must be static apart from
            the batch (a dynamic batch runs at 1 unless ``batch_sizes`` says otherwise).
        batch_sizes: batch sizes to time; a file with a fixed batch runs only at that batch.
        threads: inference threads (``None``: OpenVINO's default, every core).
        precision: ``fp32``, ``bf16`` or ``int8`` (``None``: the one the file records, else ``fp32``).
        warmup: untimed calls before timing each batch size.
        repeats: timed calls per batch size.

    Returns:
        one :class:`Latency` per batch size.

    Raises:
        OptkitError: if OpenVINO is missing, the file cannot be read or compiled, its shape is unknown, or it
            fails to run.
    """
    from optkit.analysis.metrics import time_callable
    from optkit.export import openvino as ov

    _check_counts(warmup, repeats)
    model = ov.read(path)
    precision = precision or ov.recorded_precision(model) or "fp32"
    declared = [d.get_length() if d.is_static else "?" for d in model.inputs[0].get_partial_shape()]
    shape = tuple(input_shape) if input_shape is not None else _static_shape(path, declared, batch_sizes)
    results = []
    for run_shape in _shapes(shape, batch_sizes):
        if len(declared) == len(run_shape) and isinstance(declared[0], int) and declared[0] != run_shape[0]:
            raise OptkitError(f"{path} was exported with a fixed batch of {declared[0]}; "
                              f"it cannot run batch {run_shape[0]} (export with a dynamic batch)")
        compiled = ov.compile_model(model, precision=precision, threads=threads, input_shape=run_shape)
        request, feed = compiled.create_infer_request(), openvino_feed(compiled, run_shape)
        try:
            timing = time_callable(lambda: request.infer(feed), warmup=warmup, repeats=repeats)
        except Exception as e:
            raise OptkitError(f"{path} does not run in OpenVINO on input shape {','.join(map(str, run_shape))} "
                              f"({e})") from e
        results.append(_latency("openvino", "cpu", run_shape, threads, timing, warmup, precision))
    return results


def is_onnx(spec: str | os.PathLike) -> bool:
    """Whether a model spec names an ONNX file (by its ``.onnx`` suffix)."""
    return os.fspath(spec).lower().endswith(".onnx")


def is_openvino(spec: str | os.PathLike) -> bool:
    """Whether a model spec names an OpenVINO IR (by its ``.xml`` suffix)."""
    return os.fspath(spec).lower().endswith(".xml")


def onnx_feed(session: Any, shape: Sequence[int], *, seed: int = 0) -> dict[str, Any]:
    """Inputs for every input of an ONNX Runtime session at one example ``shape`` (batch first).

    Floating inputs get reproducible standard-normal values; integer inputs (token ids,
    attention masks) get ones, a valid id and mask in any vocabulary. An input of one
    dimension fewer than ``shape`` is one of a list of images and gets ``shape[1:]``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in shape)
    feed = {}
    for node in session.get_inputs():
        size = shape[1:] if len(node.shape) == len(shape) - 1 else shape
        if "int" in node.type:
            feed[node.name] = np.ones(size, dtype=np.int32 if "int32" in node.type else np.int64)
        else:
            feed[node.name] = rng.standard_normal(size, dtype=np.float32)
    return feed


def openvino_feed(compiled: Any, shape: Sequence[int], *, seed: int = 0) -> dict[int, Any]:
    """Inputs for every input of an OpenVINO compiled model, by index, as :func:`onnx_feed` makes them: the same
    values for the same file, whichever runtime runs it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in shape)
    feed = {}
    for index, node in enumerate(compiled.inputs):
        size = shape[1:] if node.get_partial_shape().rank.get_length() == len(shape) - 1 else shape
        dtype = node.get_element_type()
        if dtype.is_real():
            feed[index] = rng.standard_normal(size, dtype=np.float32)
        else:
            feed[index] = np.ones(size, dtype=np.int32 if dtype.get_type_name() == "i32" else np.int64)
    return feed


def _static_shape(path, declared: Sequence[Any], batch_sizes: Sequence[int] | None) -> tuple[int, ...]:
    dims = list(declared)
    if not isinstance(dims[0], int):
        dims[0] = batch_sizes[0] if batch_sizes else 1
    if not all(isinstance(d, int) and d > 0 for d in dims):
        raise OptkitError(f"{path} declares input shape {declared} with symbolic dimensions; "
                          "give --input-shape (e.g. 1,3,224,224)")
    return tuple(dims)


def _shapes(input_shape: Sequence[int], batch_sizes: Sequence[int] | None) -> list[tuple[int, ...]]:
    shape = tuple(int(v) for v in input_shape)
    if not batch_sizes:
        return [shape]
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
    return [(int(b),) + shape[1:] for b in batch_sizes]


def compare(a: list[Latency], b: list[Latency]) -> list[dict[str, Any]]:
    """Pair two benchmark runs by (engine, batch size) and give the ratio of their medians.

    Runs in different engines (an ONNX file in ONNX Runtime against its OpenVINO IR) pair by batch size
    when each run used one engine.

    Returns:
        one entry per pair: ``engine`` (``A / B`` when they differ), ``batch_size``, ``a_median_ms``,
        ``b_median_ms`` and ``speedup`` (``a / b``: above 1 means B is faster), plus ``noisy`` when the
        difference is within either run's spread.
    """
    engines_a, engines_b = {r.engine for r in a}, {r.engine for r in b}
    across = engines_a != engines_b and len(engines_a) == len(engines_b) == 1
    by_key = {(None if across else r.engine, r.batch_size): r for r in b}
    pairs = []
    for ra in a:
        rb = by_key.get((None if across else ra.engine, ra.batch_size))
        if rb is None:
            continue
        speedup = ra.median_ms / rb.median_ms if rb.median_ms else float("inf")
        # Within the larger p90/median spread, the difference could be noise.
        noisy = max(speedup, 1 / speedup if speedup else float("inf")) < max(ra.spread, rb.spread)
        engine = f"{ra.engine} / {rb.engine}" if across else ra.engine
        pairs.append({"engine": engine, "batch_size": ra.batch_size, "a_median_ms": ra.median_ms,
                      "b_median_ms": rb.median_ms, "speedup": speedup, "noisy": noisy})
    return pairs


def onnx_session(path: str | os.PathLike, threads: int, *, spinning: bool = False):
    """A CPU ONNX Runtime session with ``threads`` intra-op threads.

    Args:
        path: the ONNX file.
        threads: intra-op threads.
        spinning: let idle pool threads spin for work, as ONNX Runtime does by
            default. Fastest for one session called in a loop (how a model is
            served), but the spinning threads of one session slow down any
            other session running in the process, so it is off unless asked.

    Raises:
        OptkitError: if ONNX Runtime cannot load the file.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OptkitError(f"{path}: ONNX Runtime cannot load it ({e})") from e


def interleaved_latency(paths: Sequence[str | os.PathLike | Deployment], input_shape: Sequence[int], *,
                        threads: int = 1, warmup: int = 2, repeats: int = 20, block: int = 2,
                        seed: int = 0) -> list[Latency]:
    """Time several files on the same random inputs (see :func:`onnx_feed`), in alternating blocks.

    Each file is timed the way it is served, in its runtime (an ONNX file in
    ONNX Runtime, a ``.xml`` in OpenVINO, or as a :class:`Deployment` says):
    one session (an OpenVINO compiled model, for one stream at the input's
    fixed shape), ONNX Runtime's spinning thread pool, calls back to back.
    Only one session exists at a time: a block of ``block`` timed calls runs
    on a fresh session after ``warmup`` untimed calls, then the session is
    closed and the next file's block runs, round after round. Two live
    sessions would slow each other down (idle spinning threads, up to 2x at 2
    threads on 2 cores), and turning spinning off to avoid that charges every
    operator a thread wake-up, which penalizes small (pruned) models unfairly.
    The alternation spreads a change in machine load over all files alike.

    Blocks are short because a session's speed is partly luck: calls within
    one session agree closely, but fresh sessions of the same file differ by
    up to 15% (buffer placement, which core the pool thread lands on). The
    median over many short-lived sessions is what a model runs at; on a
    2-core virtual machine, efficientnet_b0's pruned/original fraction timed
    six times had a standard deviation of 0.11 with blocks of 5 (one run off
    by 0.25) and 0.015 with blocks of 2.

    Args:
        paths: the files, or :class:`Deployment` s (all must accept ``input_shape``).
        input_shape: the input shape of one call, batch first.
        threads: intra-op threads of every session.
        warmup: untimed calls on each fresh session.
        repeats: timed calls of each file in all (rounded up to whole blocks).
        block: timed calls per session.
        seed: seed of the random input.

    Returns:
        one :class:`optkit.analysis.latency.Latency` per file, in order, with the runtime as its ``engine``.

    Raises:
        ValueError: for ``repeats < 1``, ``block < 1`` or ``warmup < 0``.
        OptkitError: if a file cannot be loaded or run.
    """
    import gc

    from optkit.analysis.metrics import summarize_ms

    if repeats < 1 or warmup < 0 or block < 1:
        raise ValueError(f"warmup must be >= 0, repeats and block >= 1, got warmup={warmup}, repeats={repeats}, "
                         f"block={block}")
    shape = tuple(int(v) for v in input_shape)
    block = min(block, repeats)
    targets = [as_deployment(path) for path in paths]
    openers = [_opener(target, shape, threads) for target in targets]
    samples: list[list[float]] = [[] for _ in targets]
    try:
        for _ in range(-(-repeats // block)):
            for open_session, out in zip(openers, samples):
                call = open_session(seed)
                for _ in range(warmup):
                    call()
                for _ in range(block):
                    start = time.perf_counter()
                    call()
                    out.append((time.perf_counter() - start) * 1000.0)
                del call
                gc.collect()
    except OptkitError:
        raise
    except Exception as e:
        raise OptkitError(f"a runtime failed to run on input shape {','.join(map(str, shape))} ({e})") from e
    return [_latency(target.runtime, "cpu", shape, threads, summarize_ms(s), warmup, target.precision)
            for target, s in zip(targets, samples)]


def _opener(target: Deployment, shape: tuple[int, ...], threads: int):
    """A function that opens a fresh session of ``target`` and returns one call of it on reproducible inputs."""
    if target.runtime == "openvino":
        from optkit.export import openvino as ov

        model = ov.read(target.path)
        precision = target.precision or ov.recorded_precision(model) or "fp32"
        ov.fix_shape(model, shape)

        def open_openvino(seed: int):
            compiled = ov.compile_model(model, precision=precision, threads=threads)
            request, feed = compiled.create_infer_request(), openvino_feed(compiled, shape, seed=seed)
            return lambda: request.infer(feed)

        return open_openvino

    def open_onnxruntime(seed: int):
        session = onnx_session(target.path, threads, spinning=True)
        feed = onnx_feed(session, shape, seed=seed)
        return lambda: session.run(None, feed)

    return open_onnxruntime
