"""Latency measurement: PyTorch eager and ONNX Runtime, with the noise reported.

Each measurement runs a few untimed warm-up calls, then times ``repeats``
calls one by one (:func:`optkit.analysis.metrics.time_callable`) and reports the
median, the 90th percentile and their ratio (``spread``): a spread well above
1 means the machine was noisy and small differences mean nothing.
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

ENGINES = ("torch", "onnxruntime")


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
        engine: ``torch`` (eager) or ``onnxruntime``.
        device: where it ran (``cpu``, ``cuda``).
        batch_size: inputs per call.
        input_shape: the full input shape of one call.
        threads: intra-op threads used (``None``: the engine's default).
        median_ms, p90_ms, min_ms, max_ms: latency of one call in milliseconds.
        spread: ``p90_ms / median_ms`` (1.0 means no noise).
        repeats: timed calls; warmup: untimed calls before them.
        throughput: inputs per second at the median latency.
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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        return out


def _latency(engine: str, device: str, shape: tuple[int, ...], threads: int | None, timing: dict[str, float],
             warmup: int) -> Latency:
    median = timing["median_ms"]
    return Latency(engine, device, shape[0], shape, threads, median, timing["p90_ms"], timing["min_ms"],
                   timing["max_ms"], timing["spread"], int(timing["repeats"]), warmup,
                   shape[0] * 1000.0 / median if median else 0.0)


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
                   threads: int | None = None, device: str = "cpu", warmup: int = 5,
                   repeats: int = 30) -> list[Latency]:
    """Time a PyTorch model in ONNX Runtime: export it to a temporary file, then :func:`bench_onnx`.

    The export is :func:`optkit.export.onnx.export_onnx` with a dynamic batch, so
    the file is verified against PyTorch before it is timed. Arguments are
    those of :func:`bench_torch`.

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
        return bench_onnx(path, shape, batch_sizes=batch_sizes, threads=threads, device=device,
                          warmup=warmup, repeats=repeats)


def is_onnx(spec: str | os.PathLike) -> bool:
    """Whether a model spec names an ONNX file (by its ``.onnx`` suffix)."""
    return os.fspath(spec).lower().endswith(".onnx")


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

    Returns:
        one entry per pair: ``engine``, ``batch_size``, ``a_median_ms``,
        ``b_median_ms`` and ``speedup`` (``a / b``: above 1 means B is faster),
        plus ``noisy`` when the difference is within either run's spread.
    """
    by_key = {(r.engine, r.batch_size): r for r in b}
    pairs = []
    for ra in a:
        rb = by_key.get((ra.engine, ra.batch_size))
        if rb is None:
            continue
        speedup = ra.median_ms / rb.median_ms if rb.median_ms else float("inf")
        # Within the larger p90/median spread, the difference could be noise.
        noisy = max(speedup, 1 / speedup if speedup else float("inf")) < max(ra.spread, rb.spread)
        pairs.append({"engine": ra.engine, "batch_size": ra.batch_size, "a_median_ms": ra.median_ms,
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


def interleaved_latency(paths: Sequence[str | os.PathLike], input_shape: Sequence[int], *, threads: int = 1,
                        warmup: int = 2, repeats: int = 20, block: int = 2, seed: int = 0) -> list[Latency]:
    """Time several ONNX files on the same random inputs (see :func:`onnx_feed`), in alternating blocks.

    Each file is timed the way it is served: one session, spinning thread
    pool (ONNX Runtime's default), calls back to back. Only one session
    exists at a time: a block of ``block`` timed calls runs on a fresh
    session after ``warmup`` untimed calls, then the session is closed and
    the next file's block runs, round after round. Two live sessions would
    slow each other down (idle spinning threads, up to 2x at 2 threads on 2
    cores), and turning spinning off to avoid that charges every operator a
    thread wake-up, which penalizes small (pruned) models unfairly. The
    alternation spreads a change in machine load over all files alike.

    Blocks are short because a session's speed is partly luck: calls within
    one session agree closely, but fresh sessions of the same file differ by
    up to 15% (buffer placement, which core the pool thread lands on). The
    median over many short-lived sessions is what a model runs at; on a
    2-core virtual machine, efficientnet_b0's pruned/original fraction timed
    six times had a standard deviation of 0.11 with blocks of 5 (one run off
    by 0.25) and 0.015 with blocks of 2.

    Args:
        paths: the files (all must accept ``input_shape``).
        input_shape: the input shape of one call, batch first.
        threads: intra-op threads of every session.
        warmup: untimed calls on each fresh session.
        repeats: timed calls of each file in all (rounded up to whole blocks).
        block: timed calls per session.
        seed: seed of the random input.

    Returns:
        one :class:`optkit.analysis.latency.Latency` per file, in order.

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
    samples: list[list[float]] = [[] for _ in paths]
    try:
        for _ in range(-(-repeats // block)):
            for path, out in zip(paths, samples):
                session = onnx_session(path, threads, spinning=True)
                inputs = onnx_feed(session, shape, seed=seed)
                for _ in range(warmup):
                    session.run(None, inputs)
                for _ in range(block):
                    start = time.perf_counter()
                    session.run(None, inputs)
                    out.append((time.perf_counter() - start) * 1000.0)
                del session
                gc.collect()
    except OptkitError:
        raise
    except Exception as e:
        raise OptkitError(f"ONNX Runtime failed to run on input shape {','.join(map(str, shape))} ({e})") from e
    return [_latency("onnxruntime", "cpu", shape, threads, summarize_ms(s), warmup) for s in samples]
