"""Which op groups to leave in FP32, found by timing them on this machine.

INT8 is not faster everywhere: on a 2-core AVX-512 CPU, efficientnet_b0 hand-quantized
ran no faster than FP32 (its SiLU = Sigmoid·Mul and depthwise convolutions gain nothing
and pay for the extra Quantize/Dequantize steps). The rule here measures instead
of guessing: the graph's quantizable nodes are grouped by op type (depthwise
convolutions apart from the others), heaviest first (most weights, then most
nodes), and quantized one group at a time on top of the groups already kept;
each step is timed against the model before it, interleaved, and a group that
makes the model more than :data:`MARGIN` slower is left in FP32. One group at a
time on top of the others, not each group alone: a lone INT8 island among FP32
layers pays for conversions at its borders that it would not pay in the full model.
For the same reason the fully quantized model is timed last against the choice.

A group can be fast as a whole and hold a few nodes that are not: an INT8
convolution reading three input channels (an image stem) or a narrow depthwise
one at full resolution ran twice as long as in FP32 here, inside models whose
other convolutions gain 2-3x. After the groups are chosen, ONNX Runtime's
profiler gives each node's kernel time in the FP32 model and in the chosen
INT8 one (:mod:`optkit.passes.quantize.profile`); the nodes whose INT8 kernels
take clearly longer are left in FP32 together, and that is kept only if the
whole model, timed against the choice, runs faster.

The verdicts are cached per machine (CPU model, core count, ONNX Runtime
version, thread count) and per graph structure (op types, attributes, weight
shapes; not weight values), so a retrained model of the same architecture reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

#: How much slower quantizing a group must make the model for the group to stay FP32 (a noise guard).
MARGIN = 0.05
DEPTHWISE = "Conv(depthwise)"
#: A node's INT8 kernels must take longer than its FP32 ones by this share of the INT8 model's traced time
#: for the node to be tried in FP32 (smaller differences do not pay for the conversions at its borders).
NODE_SHARE = 0.02
#: ``timer(paths) -> median milliseconds of each``, timed interleaved.
Timer = Callable[[Sequence[Path]], list[float]]
#: ``profiler(path) -> {node name: milliseconds}``, each node's kernel time when the file runs.
Profiler = Callable[[Path], dict[str, float]]


def op_groups(path: str | os.PathLike, op_types: Collection[str]) -> dict[str, list[str]]:
    """The named nodes of ``op_types`` in an ONNX file, by group (op type; depthwise convolutions apart).

    Returns:
        ``{group: [node names]}``, heaviest group first: most weight values, then most nodes.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    shapes = {init.name: tuple(init.dims) for init in graph.initializer}
    computed_otherwise = non_float_tensors(model)
    groups: dict[str, list[str]] = {}
    weights: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in op_types and node.name and not (node.output and node.output[0] in computed_otherwise):
            group = _group(node, shapes)
            groups.setdefault(group, []).append(node.name)
            weights[group] = weights.get(group, 0) + sum(math.prod(shapes[i]) for i in node.input if i in shapes)
    return dict(sorted(groups.items(), key=lambda item: (-weights[item[0]], -len(item[1]))))


def non_float_tensors(model) -> set[str]:
    """The tensors of ``model`` that shape inference types as other than floating point.

    An exported model computes shapes in int64 (``Shape -> Gather -> Add`` where a model splits its channels in
    halves): those nodes are of a quantizable op type but are never quantized, so they are neither timed as a
    group nor scored by the exclusion search (a probe that declared their outputs float would not load).
    """
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model).graph
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    return {v.name for v in [*inferred.value_info, *inferred.input, *inferred.output]
            if v.type.tensor_type.elem_type and v.type.tensor_type.elem_type not in floats}


def _group(node, shapes: dict[str, tuple[int, ...]]) -> str:
    if node.op_type == "Conv":
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
        if group > 1 and weight is not None and len(weight) > 1 and weight[1] == 1:
            return DEPTHWISE
    return node.op_type


def measure_gains(fp32_path: Path, groups: dict[str, list[str]], build: Callable[[Collection[str]], Path],
                  timer: Timer) -> tuple[dict[str, float], list[str]]:
    """Quantize the groups one at a time, in order, keeping each that does not slow the model down.

    A last step times the fully quantized model against the one chosen, and takes it when it is faster:
    groups that each slow the model alone can speed it up together (no FP32/INT8 borders left between them).

    Args:
        fp32_path: the FP32 model (the first step's reference).
        groups: ``{group: node names}`` in the order to try them (see :func:`op_groups`).
        build: writes the model quantized with the given nodes left in FP32 and returns its path.
        timer: times files interleaved (injected, so tests never time anything).

    Returns:
        ``({group: time before / time with the group quantized}, groups to leave in FP32)``; the key
        ``"all"`` holds the chosen model's time / the fully quantized model's time when that step ran.
    """
    kept: list[str] = []
    current = fp32_path
    gains: dict[str, float] = {}
    for name in groups:
        chosen = {*kept, name}
        candidate = build([node for group, nodes in groups.items() if group not in chosen for node in nodes])
        gains[name] = _gain(timer([current, candidate]))
        if gains[name] >= 1 - MARGIN:
            kept.append(name)
            current = candidate
    slow = [name for name in groups if name not in kept]
    if slow:
        gains["all"] = _gain(timer([current, build(())]))
        if gains["all"] > 1 + MARGIN:
            slow = []
    return gains, slow


def slow_nodes(fp32_path: Path, int8_path: Path, excluded: Collection[str], build: Callable[[Collection[str]], Path],
               timer: Timer, profiler: Profiler) -> tuple[list[str], float | None]:
    """Nodes of the chosen INT8 model whose INT8 kernels are slower than their FP32 ones, confirmed by timing.

    Nodes whose INT8 kernel time exceeds their FP32 one by more than :data:`NODE_SHARE` of the INT8
    model's traced time are left in FP32 together; if the whole model does not then run faster than
    the choice by :data:`MARGIN`, the worst node alone is tried.

    Args:
        fp32_path: the FP32 model.
        int8_path: the chosen INT8 model (built with ``excluded`` left in FP32).
        excluded: the nodes already left in FP32.
        build: writes the model quantized with the given nodes left in FP32 and returns its path.
        timer: times files interleaved.
        profiler: per-node kernel times of a file, keyed by the FP32 graph's node names.

    Returns:
        ``(nodes to leave in FP32 as well, time of the choice / time with them in FP32)``; the gain is
        ``None`` when no node was slow enough to try.
    """
    fp32, int8 = profiler(fp32_path), profiler(int8_path)
    total, already = sum(int8.values()), set(excluded)
    excess = {node: ms - fp32[node] for node, ms in int8.items() if node in fp32 and node not in already}
    worst = sorted((n for n, e in excess.items() if e > NODE_SHARE * total), key=lambda n: -excess[n])
    gain = None
    for nodes in ([worst, worst[:1]] if len(worst) > 1 else [worst] if worst else []):
        gain = _gain(timer([int8_path, build([*excluded, *nodes])]))
        if gain > 1 + MARGIN:
            return nodes, gain
    return [], gain


def _gain(times: list[float]) -> float:
    before, after = times
    return round(before / after, 4) if after > 0 else 1.0


def graph_digest(path: str | os.PathLike) -> str:
    """A hash of an ONNX graph's structure: op types, attributes, inputs and weight shapes (not weight values)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    h = hashlib.sha256()
    for init in graph.initializer:
        h.update(f"{init.name}:{tuple(init.dims)}:{init.data_type};".encode())
    for node in graph.node:
        attributes = [onnx.helper.get_attribute_value(a) for a in node.attribute if a.type != onnx.AttributeProto.TENSOR]
        h.update(f"{node.op_type}|{list(node.input)}|{list(node.output)}|{attributes!r};".encode())
    for value in graph.input:
        h.update(str(value.type).encode())
    return h.hexdigest()[:16]


def machine_key(threads: int) -> str:
    """What the op speeds depend on besides the graph: CPU model, core count, ONNX Runtime version, threads."""
    import onnxruntime

    from optkit.analysis.latency import cpu_model

    return f"{cpu_model()}|{os.cpu_count()} cpus|onnxruntime {onnxruntime.__version__}|{threads} threads"


def default_cache_path() -> Path:
    """``int8-op-speed.json`` in optkit's cache folder (:func:`optkit.core.files.cache_dir`)."""
    from optkit.core.files import cache_dir

    return cache_dir() / "int8-op-speed.json"


class GainCache:
    """Measured verdicts kept in a JSON file:
    ``{machine key: {graph digest: {"gains": ..., "fp32_groups": ..., "fp32_nodes": ...}}}``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, machine: str, digest: str) -> tuple[dict[str, float], list[str], list[str]] | None:
        """The cached ``(gains, FP32 groups, FP32 nodes)`` for a graph on a machine, or ``None``."""
        found = self._read().get(machine, {}).get(digest)
        try:
            return ({str(k): float(v) for k, v in found["gains"].items()}, [str(g) for g in found["fp32_groups"]],
                    [str(n) for n in found["fp32_nodes"]])
        except (TypeError, KeyError, ValueError, AttributeError):
            return None

    def put(self, machine: str, digest: str, gains: dict[str, float], fp32_groups: list[str],
            fp32_nodes: list[str]) -> None:
        """Store a verdict (atomically; a cache that cannot be written is skipped, it only saves time)."""
        from optkit.core.files import write_text

        data = self._read()
        data.setdefault(machine, {})[digest] = {"gains": gains, "fp32_groups": fp32_groups, "fp32_nodes": fp32_nodes}
        try:
            write_text(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass
