"""ONNX Runtime sessions: the one place optkit opens them (threads, spinning, providers), and example feeds.

Every ONNX Runtime session optkit runs (verifying an export, scoring a file,
timing, INT8 checks and profiles, decode graphs) comes from :func:`onnx_session`,
so how threads are set is decided here once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from optkit.core.errors import OptkitError

__all__ = ["onnx_feed", "onnx_session"]


def onnx_session(path: str | os.PathLike, threads: int | None = None, *, spinning: bool | None = None,
                 device: str = "cpu", profile_prefix: str | os.PathLike | None = None) -> Any:
    """An ONNX Runtime session of an ONNX file.

    Args:
        path: the ONNX file.
        threads: intra-op threads, run one operator at a time (``inter_op_num_threads`` 1, sequential
            execution); ``None``: ONNX Runtime's defaults.
        spinning: whether idle pool threads spin for work (``None``: ONNX Runtime's default, which
            spins). Spinning is fastest for one session called in a loop (how a model is served), but
            the spinning threads of one session slow down any other session running in the process.
        device: ``cpu``, or ``cuda`` to put the CUDA execution provider first.
        profile_prefix: turn ONNX Runtime's profiler on, writing its trace to files starting with this.

    Raises:
        OptkitError: if CUDA was asked for and ONNX Runtime here has no CUDA provider, or ONNX Runtime
            cannot load the file.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = os.fspath(profile_prefix)
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise OptkitError("ONNX Runtime here has no CUDA execution provider; use --device cpu or install onnxruntime-gpu")
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(os.fspath(path), options, providers=providers)
    except Exception as e:
        raise OptkitError(f"{path}: ONNX Runtime cannot load it ({e})") from e


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
