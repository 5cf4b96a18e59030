"""FP32 vs INT8 latency in ONNX Runtime, timed side by side in one process (see
:func:`optkit.analysis.latency.interleaved_latency`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from optkit.analysis.latency import interleaved_latency


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
        FP32 and INT8 :class:`Latency` as dicts, ``speedup`` (FP32 median / INT8 median),
        ``noisy`` (the speedup is within the larger p90/median spread) and ``not_a_result`` (why the timing, taken
        again once when the machine was loaded or noisy, still is not one; ``None`` for a result).

    Raises:
        OptkitError: if a file cannot be loaded or run.
    """
    load_start = os.getloadavg()[0]
    runs = []
    for n_threads in threads:
        for batch in batch_sizes:
            fp32, int8 = interleaved_latency([fp32_path, int8_path], (int(batch), *tuple(input_shape)[1:]),
                                             threads=int(n_threads), warmup=warmup, repeats=repeats, retries=1)
            speedup = fp32.median_ms / int8.median_ms if int8.median_ms else float("inf")
            runs.append({"batch_size": int(batch), "threads": int(n_threads), "fp32": fp32.to_dict(),
                         "int8": int8.to_dict(), "speedup": round(speedup, 3),
                         "noisy": max(speedup, 1 / speedup) < max(fp32.spread, int8.spread),
                         "not_a_result": fp32.flag() or int8.flag()})
    return {"load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)], "runs": runs}
