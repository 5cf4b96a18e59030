"""FP32 vs INT8 latency in ONNX Runtime, timed side by side in one process.

Several sessions in one process are timed interleaved (one call of each in
turn), so a change in machine load slows all of them alike, and with
``session.intra_op.allow_spinning = 0``: idle ONNX Runtime threads otherwise
spin and take cores from the session being timed (measured here: up to 2×).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from optkit.analysis.latency import Latency
from optkit.core.errors import OptkitError


def session(path: str | os.PathLike, threads: int):
    """A CPU ONNX Runtime session with ``threads`` intra-op threads that do not spin while idle.

    Raises:
        OptkitError: if ONNX Runtime cannot load the file.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OptkitError(f"{path}: ONNX Runtime cannot load it ({e})") from e


def interleaved_latency(paths: Sequence[str | os.PathLike], input_shape: Sequence[int], *, threads: int = 1,
                        warmup: int = 3, repeats: int = 20, seed: int = 0) -> list[Latency]:
    """Time several single-input ONNX files on the same random input, one call of each in turn.

    Args:
        paths: the files (all must accept ``input_shape``).
        input_shape: the input shape of one call, batch first.
        threads: intra-op threads of every session.
        warmup: untimed calls of each file first.
        repeats: timed calls of each file.
        seed: seed of the random input.

    Returns:
        one :class:`optkit.analysis.latency.Latency` per file, in order.

    Raises:
        ValueError: for ``repeats < 1`` or ``warmup < 0``.
        OptkitError: if a file cannot be loaded or run.
    """
    import numpy as np

    if repeats < 1 or warmup < 0:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    shape = tuple(int(v) for v in input_shape)
    feed = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    sessions = [session(p, threads) for p in paths]
    calls = [lambda s=s: s.run(None, {s.get_inputs()[0].name: feed}) for s in sessions]
    samples: list[list[float]] = [[] for _ in calls]
    try:
        for call in calls:
            for _ in range(warmup):
                call()
        for _ in range(repeats):
            for call, out in zip(calls, samples):
                start = time.perf_counter()
                call()
                out.append((time.perf_counter() - start) * 1000.0)
    except Exception as e:
        raise OptkitError(f"ONNX Runtime failed to run on input shape {','.join(map(str, shape))} ({e})") from e
    return [_latency(sorted(s), shape, threads, warmup) for s in samples]


def _latency(samples: list[float], shape: tuple[int, ...], threads: int, warmup: int) -> Latency:
    median = statistics.median(samples)
    p90 = samples[min(len(samples) - 1, int(round(0.9 * (len(samples) - 1))))]
    return Latency("onnxruntime", "cpu", shape[0], shape, threads, median, p90, samples[0], samples[-1],
                   p90 / median if median else 0.0, len(samples), warmup,
                   shape[0] * 1000.0 / median if median else 0.0)


def compare_latency(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, input_shape: Sequence[int], *,
                    batch_sizes: Sequence[int] = (1,), threads: Sequence[int] = (1,), warmup: int = 3,
                    repeats: int = 20) -> dict[str, Any]:
    """FP32 and INT8 latency side by side, for the report.

    Args:
        fp32_path: the FP32 ONNX file.
        int8_path: the INT8 ONNX file.
        input_shape: one input's shape; its batch is replaced by each of ``batch_sizes``.
        batch_sizes: batch sizes to time.
        threads: intra-op thread counts to time.
        warmup: untimed calls of each file per setting.
        repeats: timed calls of each file per setting.

    Returns:
        ``{"load_avg_1min": [start, end], "runs": [...]}``, one run per (batch, threads) with the
        FP32 and INT8 :class:`Latency` as dicts, ``speedup`` (FP32 median / INT8 median) and
        ``noisy`` (the speedup is within the larger p90/median spread).

    Raises:
        OptkitError: if a file cannot be loaded or run.
    """
    load_start = os.getloadavg()[0]
    runs = []
    for n_threads in threads:
        for batch in batch_sizes:
            fp32, int8 = interleaved_latency([fp32_path, int8_path], (int(batch), *tuple(input_shape)[1:]),
                                             threads=int(n_threads), warmup=warmup, repeats=repeats)
            speedup = fp32.median_ms / int8.median_ms if int8.median_ms else float("inf")
            runs.append({"batch_size": int(batch), "threads": int(n_threads), "fp32": fp32.to_dict(),
                         "int8": int8.to_dict(), "speedup": round(speedup, 3),
                         "noisy": max(speedup, 1 / speedup) < max(fp32.spread, int8.spread)})
    return {"load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)], "runs": runs}
