"""Latency measurement: PyTorch eager, ONNX Runtime and OpenVINO, with the noise reported.

Each measurement runs a few untimed warm-up calls, then times ``repeats``
calls one by one (:func:`time_callable`) and reports the
median, the 90th percentile and their ratio (``spread``): a spread well above
1 means the machine was noisy and small differences mean nothing. Each
measurement also records the conditions it was taken in (:class:`Conditions`:
the 1-minute load average before and after, the cores it used, the spreads):
a timing taken on a loaded machine, or too noisy, is retried once where the
caller asks (``retries=1``, as the reports do) and, if still so, carries a
flag (:meth:`Conditions.flag`) that every report prints instead of presenting
it as a result. A file is
timed in the runtime it is deployed with: an ONNX file in ONNX Runtime (or in
OpenVINO when asked), an OpenVINO IR (``.xml``) in OpenVINO at the precision it
records (:mod:`optkit.runtime.openvino`). Sessions are opened by :mod:`optkit.runtime`, and
the files are built elsewhere (:mod:`optkit.export`): nothing here exports.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from optkit.core.errors import OptkitError
from optkit.runtime import openvino as ov
from optkit.runtime.onnxrt import onnx_feed, onnx_session

if TYPE_CHECKING:
    from torch import nn

ENGINES = ("torch", "onnxruntime", "openvino")
#: Load above the cores a timing uses that still counts as a quiet machine: this process's other threads
#: and the system's background work.
LOAD_MARGIN = 1.0
#: A p90 / median spread above this means the calls did not run at one speed: the timing is not a result.
NOISY_SPREAD = 1.3
T = TypeVar("T")


def load_average() -> float:
    """The 1-minute load average (``os.getloadavg``; 0.0 on a platform without one). Tests replace it."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Conditions:
    """What a timing was taken under, and whether that makes it a result.

    A timing is taken *under load* when the 1-minute load average, before or
    after it, exceeds the cores it uses plus :data:`LOAD_MARGIN` (other work
    then competes for those cores), and is *noisy* when the p90 / median
    spread of any of its series exceeds :data:`NOISY_SPREAD`. Either way it is
    not a result: :meth:`flag` says why, in the words reports print.

    Attributes:
        load_before, load_after: the 1-minute load average before and after the timing.
        cores: the cores the timing used (its threads, at most :func:`usable_cores`).
        spreads: p90 / median of each series timed (one per file when several were timed together).
        attempts: timings taken: 2 when the first was retried.
    """

    load_before: float
    load_after: float
    cores: int
    spreads: tuple[float, ...] = ()
    attempts: int = 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conditions:
        return cls(data["load_before"], data["load_after"], int(data["cores"]), tuple(data.get("spreads") or ()),
                   int(data.get("attempts", 1)))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spreads": list(self.spreads)}

    @property
    def load(self) -> float:
        return max(self.load_before, self.load_after)

    @property
    def loaded(self) -> bool:
        """Whether other work competed for the cores the timing used."""
        return self.load > self.cores + LOAD_MARGIN

    @property
    def noisy(self) -> bool:
        return bool(self.spreads) and max(self.spreads) > NOISY_SPREAD

    @property
    def steady(self) -> bool:
        return not self.loaded and not self.noisy

    def flag(self) -> str | None:
        """``None`` for a result; else why the timing is not one, e.g. ``"measured under load (load average 3.40
        on 2 cores): not a result"``."""
        retried = " twice" if self.attempts > 1 else ""
        if self.loaded:
            cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
            return f"measured{retried} under load (load average {self.load:.2f} on {cores}): not a result"
        if self.noisy:
            return (f"measured{retried} with p90 / median up to {max(self.spreads):.2f} (over {NOISY_SPREAD}: "
                    "the machine was busy): not a result")
        return None


def timing_flag(*timings: dict[str, Any] | None) -> str | None:
    """The first :meth:`Conditions.flag` among timings as dicts (a :class:`Latency` dict, or any dict holding
    ``conditions``); ``None`` when each is a result or records no conditions."""
    for timing in timings:
        conditions = (timing or {}).get("conditions")
        flag = Conditions.from_dict(conditions).flag() if conditions else None
        if flag:
            return flag
    return None


def measured_steadily(measure: Callable[[], T], *, threads: int | None, spreads: Callable[[T], Iterable[float]],
                      retries: int = 0) -> tuple[T, Conditions]:
    """Run ``measure`` and read the load average around it; while the timing was loaded or noisy, retry (at most
    ``retries`` more times).

    Args:
        measure: takes the timing.
        threads: the threads it uses (``None``: every core).
        spreads: the p90 / median spreads of what ``measure`` returned.
        retries: further attempts when the timing is not :attr:`Conditions.steady`.

    Returns:
        the last timing and the :class:`Conditions` it was taken in.
    """
    cores = usable_cores()
    used = min(int(threads), cores) if threads else cores
    attempt = 0
    while True:
        attempt += 1
        before = load_average()
        result = measure()
        after = load_average()
        conditions = Conditions(round(before, 2), round(after, 2), used,
                                tuple(round(float(x), 3) for x in spreads(result)), attempt)
        if conditions.steady or attempt > retries:
            return result, conditions


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
        conditions: what the timing was taken under (:class:`Conditions`), when recorded.
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
    conditions: Conditions | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        out["conditions"] = self.conditions.to_dict() if self.conditions is not None else None
        return out

    def flag(self) -> str | None:
        """Why this timing is not a result (:meth:`Conditions.flag`), or ``None``."""
        return self.conditions.flag() if self.conditions is not None else None


def _latency(engine: str, device: str, shape: tuple[int, ...], threads: int | None, timing: dict[str, float],
             warmup: int, precision: str | None = None, conditions: Conditions | None = None) -> Latency:
    median = timing["median_ms"]
    return Latency(engine, device, shape[0], shape, threads, median, timing["p90_ms"], timing["min_ms"],
                   timing["max_ms"], timing["spread"], int(timing["repeats"]), warmup,
                   shape[0] * 1000.0 / median if median else 0.0, precision, conditions)


def _timed(call, *, threads: int | None, warmup: int, repeats: int, retries: int) -> tuple[dict[str, float], Conditions]:
    """:func:`time_callable` of ``call`` with the conditions it ran in (see :func:`measured_steadily`)."""
    return measured_steadily(lambda: time_callable(call, warmup=warmup, repeats=repeats), threads=threads,
                             spreads=lambda timing: [timing["spread"]], retries=retries)


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
                threads: int | None = None, device: str = "cpu", warmup: int = 5, repeats: int = 30,
                retries: int = 0) -> list[Latency]:
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
        retries: timings taken again when one was loaded or noisy (see :func:`measured_steadily`).

    Returns:
        one :class:`Latency` per batch size, with the :class:`Conditions` it was taken in.

    Raises:
        OptkitError: if the model does not run at a shape, or the device is unavailable.
    """
    import torch

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
                timing, conditions = _timed(call, threads=None if device.startswith("cuda") else used_threads,
                                            warmup=warmup, repeats=repeats, retries=retries)
            except Exception as e:
                raise OptkitError(f"the model does not run on input shape {','.join(map(str, shape))} ({e}); "
                                  "set --input-shape to what it expects") from e
            results.append(_latency("torch", str(device), shape, used_threads, timing, warmup,
                                    conditions=conditions))
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
               warmup: int = 5, repeats: int = 30, retries: int = 0) -> list[Latency]:
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
        retries: timings taken again when one was loaded or noisy (see :func:`measured_steadily`).

    Returns:
        one :class:`Latency` per batch size, with the :class:`Conditions` it was taken in.

    Raises:
        OptkitError: if the file cannot be loaded, its shape is unknown, or it fails to run.
    """
    _check_counts(warmup, repeats)
    session = onnx_session(path, threads, device=device)
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
            timing, conditions = _timed(lambda: session.run(None, feed), threads=threads, warmup=warmup,
                                        repeats=repeats, retries=retries)
        except Exception as e:
            raise OptkitError(f"{path} does not run on input shape {','.join(map(str, run_shape))} ({e})") from e
        results.append(_latency("onnxruntime", device, run_shape, threads, timing, warmup, conditions=conditions))
    return results


def bench_openvino(path: str | os.PathLike, input_shape: Sequence[int] | None = None, *,
                   batch_sizes: Sequence[int] | None = None, threads: int | None = None,
                   precision: str | None = None, warmup: int = 5, repeats: int = 30,
                   retries: int = 0) -> list[Latency]:
    """Time an OpenVINO IR (``.xml``) or an ONNX file in OpenVINO on the CPU.

    Each batch size is compiled for that fixed input shape (see :func:`optkit.runtime.openvino.compile_model`).

    Args:
        path: the ``.xml`` (its ``.bin`` beside it) or ``.onnx`` file.
        input_shape: one input's shape; by default the file's declared shape, which must be static apart from
            the batch (a dynamic batch runs at 1 unless ``batch_sizes`` says otherwise).
        batch_sizes: batch sizes to time; a file with a fixed batch runs only at that batch.
        threads: inference threads (``None``: OpenVINO's default, every core).
        precision: ``fp32``, ``bf16`` or ``int8`` (``None``: the one the file records, else ``fp32``).
        warmup: untimed calls before timing each batch size.
        repeats: timed calls per batch size.
        retries: timings taken again when one was loaded or noisy (see :func:`measured_steadily`).

    Returns:
        one :class:`Latency` per batch size, with the :class:`Conditions` it was taken in.

    Raises:
        OptkitError: if OpenVINO is missing, the file cannot be read or compiled, its shape is unknown, or it
            fails to run.
    """
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
        request, feed = compiled.create_infer_request(), ov.openvino_feed(compiled, run_shape)
        try:
            timing, conditions = _timed(lambda: request.infer(feed), threads=threads, warmup=warmup,
                                        repeats=repeats, retries=retries)
        except Exception as e:
            raise OptkitError(f"{path} does not run in OpenVINO on input shape {','.join(map(str, run_shape))} "
                              f"({e})") from e
        results.append(_latency("openvino", "cpu", run_shape, threads, timing, warmup, precision, conditions))
    return results


def is_onnx(spec: str | os.PathLike) -> bool:
    """Whether a model spec names an ONNX file (by its ``.onnx`` suffix)."""
    return os.fspath(spec).lower().endswith(".onnx")


def is_openvino(spec: str | os.PathLike) -> bool:
    """Whether a model spec names an OpenVINO IR (by its ``.xml`` suffix)."""
    return os.fspath(spec).lower().endswith(".xml")


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
        difference is within either run's spread, and ``not_a_result`` (:meth:`Conditions.flag`) when either
        timing was taken under load or too noisy.
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
        flag = ra.flag() or rb.flag()
        if flag:
            pairs[-1]["not_a_result"] = flag
    return pairs


def interleaved_latency(paths: Sequence[str | os.PathLike | Deployment], input_shape: Sequence[int], *,
                        threads: int = 1, warmup: int = 2, repeats: int = 20, block: int = 2,
                        seed: int = 0, retries: int = 0) -> list[Latency]:
    """Time several files on the same random inputs (:func:`optkit.runtime.onnxrt.onnx_feed`), in alternating
    blocks.

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
        retries: times all files are timed again when the machine was loaded or a file's spread was large
            (see :func:`measured_steadily`).

    Returns:
        one :class:`optkit.analysis.latency.Latency` per file, in order, with the runtime as its ``engine``,
        each with the :class:`Conditions` of the timing (one for all files: they were timed together).

    Raises:
        ValueError: for ``repeats < 1``, ``block < 1`` or ``warmup < 0``.
        OptkitError: if a file cannot be loaded or run.
    """
    import gc

    if repeats < 1 or warmup < 0 or block < 1:
        raise ValueError(f"warmup must be >= 0, repeats and block >= 1, got warmup={warmup}, repeats={repeats}, "
                         f"block={block}")
    shape = tuple(int(v) for v in input_shape)
    block = min(block, repeats)
    targets = [as_deployment(path) for path in paths]
    openers = [_opener(target, shape, threads) for target in targets]

    def timed() -> list[dict[str, float]]:
        samples: list[list[float]] = [[] for _ in targets]
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
        return [summarize_ms(s) for s in samples]

    try:
        timings, conditions = measured_steadily(timed, threads=threads, retries=retries,
                                                spreads=lambda found: [t["spread"] for t in found])
    except OptkitError:
        raise
    except Exception as e:
        raise OptkitError(f"a runtime failed to run on input shape {','.join(map(str, shape))} ({e})") from e
    return [_latency(target.runtime, "cpu", shape, threads, timing, warmup, target.precision, conditions)
            for target, timing in zip(targets, timings)]


def _opener(target: Deployment, shape: tuple[int, ...], threads: int):
    """A function that opens a fresh session of ``target`` and returns one call of it on reproducible inputs."""
    if target.runtime == "openvino":
        model = ov.read(target.path)
        precision = target.precision or ov.recorded_precision(model) or "fp32"
        ov.fix_shape(model, shape)

        def open_openvino(seed: int):
            compiled = ov.compile_model(model, precision=precision, threads=threads)
            request, feed = compiled.create_infer_request(), ov.openvino_feed(compiled, shape, seed=seed)
            return lambda: request.infer(feed)

        return open_openvino

    def open_onnxruntime(seed: int):
        session = onnx_session(target.path, threads, spinning=True)
        feed = onnx_feed(session, shape, seed=seed)
        return lambda: session.run(None, feed)

    return open_onnxruntime


def onnx_median_ms(path: str, input_shape: list[int], threads: int, repeats: int) -> float:
    """The median ms per call of one ONNX file in ONNX Runtime, timed alone (a JSON-friendly
    :func:`interleaved_latency` for :func:`optkit.analysis.fresh.call_fresh`)."""
    return interleaved_latency([path], input_shape, threads=threads, warmup=3, repeats=repeats)[0].median_ms


def time_callable(fn, *, warmup: int = 3, repeats: int = 20) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns:
        median, p90, min and max latency in milliseconds, and the spread
        (p90 / median), so noise is reported rather than hidden.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
    return summarize_ms(samples)


def summarize_ms(samples: list[float]) -> dict[str, float]:
    """Median, p90, min, max (milliseconds), spread (p90 / median) and count of timed samples."""
    samples = sorted(samples)
    median = statistics.median(samples)
    p90 = samples[min(len(samples) - 1, int(round(0.9 * (len(samples) - 1))))]
    return {"median_ms": median, "p90_ms": p90, "min_ms": samples[0], "max_ms": samples[-1],
            "spread": p90 / median if median else 0.0, "repeats": len(samples)}
