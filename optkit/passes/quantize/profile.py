"""Per-node kernel times from ONNX Runtime's profiler, keyed by the FP32 graph's node names.

ONNX Runtime rewrites a graph before it runs it, and renames what it fuses:
an FP32 convolution in the blocked (NCHWc) layout becomes a node named after
the tensor it writes plus ``_nchwc`` (the output of an activation or residual
add fused into it), and a Dequantize/op/Quantize group of a QDQ model becomes
one integer node named after the original node plus ``_token_N``. Each kernel
event is traced back to the graph's node of interest it stands for; events
that cannot be traced to exactly one such node (layout changes, the
Quantize/Dequantize steps at INT8 borders, ambiguous fusions) are left out.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import statistics
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

#: Kernels that move or convert data between layouts and types: they belong to no node of the FP32 graph.
BORDER_OPS = frozenset({"ReorderInput", "ReorderOutput", "Transpose", "QuantizeLinear", "DequantizeLinear",
                        "DynamicQuantizeLinear"})
#: Suffixes ONNX Runtime's optimizers add to the names of nodes they create.
_SUFFIXES = re.compile(r"(_token_\d+|_nchwc)+$")
#: How many producers back a fused node's output tensor may lie from the node it stands for.
_MAX_DEPTH = 3


def node_times(path: str | os.PathLike, graph_path: str | os.PathLike, nodes: Collection[str],
               input_shape: Sequence[int], *, threads: int, runs: int = 20, warmup: int = 5) -> dict[str, float]:
    """Median milliseconds per run that each of ``nodes`` takes when ``path`` runs in ONNX Runtime.

    Args:
        path: the model to profile (the FP32 model or a quantized copy of it).
        graph_path: the FP32 graph whose node names are the keys (the one ``path`` was quantized from).
        nodes: the node names of interest.
        input_shape: the input shape of one run.
        threads: ONNX Runtime intra-op threads.
        runs: profiled runs (the median over runs is kept).
        warmup: runs first whose kernel times are left out (caches and thread pools warming up).

    Returns:
        ``{node name: ms}`` for the nodes whose kernels could be traced.
    """
    import numpy as np

    from optkit.runtime.onnxrt import onnx_session

    resolve = _resolver(graph_path, set(nodes))
    feed = np.random.default_rng(0).standard_normal(tuple(input_shape), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="optkit-profile-") as folder:
        session = onnx_session(path, threads, profile_prefix=Path(folder) / "profile")
        inputs = {session.get_inputs()[0].name: feed}
        for _ in range(warmup + runs):
            session.run(None, inputs)
        events = json.loads(Path(session.end_profiling()).read_text(encoding="utf-8"))
    per_run: dict[str, list[float]] = {}
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")[warmup:]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if event.get("args", {}).get("op_name") in BORDER_OPS or not starts or event["ts"] < starts[0]:
            continue
        node = resolve(event["name"][: -len("_kernel_time")])
        if node is not None:
            index = bisect.bisect_right(starts, event["ts"]) - 1
            times = per_run.setdefault(node, [0.0] * len(starts))
            times[index] += event["dur"] / 1000.0
    return {node: statistics.median(times) for node, times in per_run.items()}


def _resolver(graph_path: str | os.PathLike, nodes: set[str]):
    """``resolve(kernel name) -> node name or None`` for the graph at ``graph_path``."""
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    producer = {output: node for node in graph.node for output in node.output}

    def nearest(tensor: str) -> set[str]:
        """The nodes of interest fewest producers back from ``tensor``."""
        frontier = {tensor}
        for _ in range(_MAX_DEPTH + 1):
            found = {producer[t].name for t in frontier if t in producer and producer[t].name in nodes}
            if found:
                return found
            frontier = {i for t in frontier if t in producer for i in producer[t].input}
        return set()

    def resolve(kernel: str) -> str | None:
        for name in dict.fromkeys((kernel, _SUFFIXES.sub("", kernel))):
            if name in nodes:
                return name
            if name in producer:
                found = nearest(name)
                return found.pop() if len(found) == 1 else None
        return None

    return resolve
