"""The exclusion search: leave the layers that hurt most in FP32, one at a time, worst first.

Each quantized node is scored by the error it adds itself: the relative error
of its output (INT8 model against FP32 model, on the same inputs) minus the
largest relative error of its activation inputs, which came from upstream. The
node with the highest score is left in FP32, the model is re-quantized (the
calibration cache makes that cheap), checked, and re-scored, until it passes
or ``max_excluded`` nodes are in FP32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optkit.passes.quantize.optypes import non_float_tensors
from optkit.passes.quantize.verify import Agreement

#: Op types the search never leaves in FP32: activations the quantizer folds away and data movement,
#: whose INT8 form loses nothing (the values are moved or clipped, not recomputed).
NOT_SEARCHED = frozenset({"Relu", "Clip", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice",
                          "Split", "Gather", "GatherElements", "MaxPool", "Pad", "Concat", "TopK", "Where", "CumSum"})
#: Inputs used to score nodes, and how many run at once (every intermediate tensor is held for those).
RANK_SAMPLES = 16
RANK_CHUNK = 2


def node_scores(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, inputs: Sequence[np.ndarray],
                candidates: Collection[str], scratch: str | os.PathLike) -> list[tuple[str, float]]:
    """Score ``candidates`` (node names) by the output error each adds, worst first.

    Args:
        fp32_path: the FP32 model the INT8 one was made from (pre-processed: node names match).
        int8_path: the INT8 model (QDQ, or dynamic: integer ops that keep the float tensors' names).
        inputs: one array per model input, in the graph's input order, samples first (images; token ids
            and their attention mask); the first :data:`RANK_SAMPLES` samples are used.
        candidates: names of the nodes that may be left in FP32.
        scratch: a folder for the two instrumented copies.

    Returns:
        ``[(node name, score)]``, highest score first.
    """
    import onnx

    model = onnx.load(str(fp32_path), load_external_data=False)
    graph = model.graph
    int8_graph = onnx.load(str(int8_path), load_external_data=False).graph
    produced = {o for n in int8_graph.node for o in n.output} | {i.name for i in int8_graph.input}
    constants = {init.name for init in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                              for o in n.output}
    nodes = [n for n in graph.node if n.name in set(candidates) and n.output]
    wanted = {n.name: (_downstream(n.output[0], graph, produced),
                       [_upstream(i, graph, produced) for i in n.input if i and i not in constants]) for n in nodes}
    # a node computing in int64 (shape arithmetic) has no error to score: its output is left out, so it is skipped
    tensors = sorted({t for out, ins in wanted.values() for t in [out, *ins]} - non_float_tensors(model))
    errors = _tensor_errors(fp32_path, int8_path, tensors, inputs, Path(scratch))
    scores = []
    for name, (out, ins) in wanted.items():
        if out in errors:
            scores.append((name, errors[out] - max((errors.get(t, 0.0) for t in ins), default=0.0)))
    return sorted(scores, key=lambda item: -item[1])


def _downstream(tensor: str, graph, produced: set[str]) -> str:
    """The tensor to compare for a node's output ``tensor``: after the activation that follows it, if one does.

    The quantizer gives ``Conv -> Relu`` one range, the Relu's, so the Conv's own output is clipped in INT8.
    """
    while True:
        consumers = [n for n in graph.node if tensor in n.input]
        single = len(consumers) == 1 and len(consumers[0].output) == 1
        if not single or (tensor in produced and consumers[0].op_type not in ("Relu", "Clip")):
            return tensor
        tensor = consumers[0].output[0]


def _upstream(tensor: str, graph, produced: set[str]) -> str:
    """The last tensor at or before ``tensor`` that both graphs have."""
    while tensor not in produced:
        producer = next((n for n in graph.node if tensor in n.output), None)
        if producer is None or not producer.input:
            break
        tensor = producer.input[0]
    return tensor


def _tensor_errors(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, tensors: list[str],
                   inputs: Sequence[np.ndarray], scratch: Path) -> dict[str, float]:
    """Relative error of each tensor (INT8 against FP32) over the first :data:`RANK_SAMPLES` inputs.

    Inputs go through :data:`RANK_CHUNK` at a time and only the norms are summed, so a large model's
    intermediate tensors are never all held at once.
    """
    fp32, fp32_names = _probe(fp32_path, tensors, scratch / "fp32-probe.onnx")
    int8, int8_names = _probe(int8_path, tensors, scratch / "int8-probe.onnx")
    shared = [t for t in tensors if t in fp32_names and t in int8_names]
    diff = dict.fromkeys(shared, 0.0)
    norm = dict.fromkeys(shared, 0.0)
    count = min(RANK_SAMPLES, len(inputs[0]))
    for start in range(0, count, RANK_CHUNK):
        x = [values[start:min(start + RANK_CHUNK, count)] for values in inputs]
        reference, quantized = fp32(x), int8(x)
        for t in shared:
            a, b = reference[fp32_names[t]], quantized[int8_names[t]].astype(np.float64)
            diff[t] += float(np.sum((b - a) ** 2))
            norm[t] += float(np.sum(a.astype(np.float64) ** 2))
    return {t: float(np.sqrt(diff[t] / norm[t])) if norm[t] > 0 else float(np.sqrt(diff[t])) for t in shared}


def _probe(path: str | os.PathLike, tensors: list[str], probe: Path):
    """A function running ``path`` with ``tensors`` as extra outputs, and where each tensor's value is found.

    Returns:
        ``(run, names)``: ``run(arrays)``, given one array per graph input, gives ``{output name: value}``; ``names`` maps each tensor the graph has
        to the output holding it (in an INT8 graph, its dequantized value).
    """
    import onnx
    from onnx import helper

    from optkit.runtime.onnxrt import onnx_session

    model = onnx.load(str(path))
    produced = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    seen = _as_seen(model.graph)
    names = {t: seen.get(t, t) for t in tensors if t in produced}
    existing = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in sorted(set(names.values())) if t not in existing)
    onnx.save(model, str(probe))
    s = onnx_session(probe, 1, spinning=False)
    probe.unlink()
    feeds = [i.name for i in s.get_inputs()]
    outputs = [o.name for o in s.get_outputs()]
    return (lambda arrays: dict(zip(outputs, s.run(None, dict(zip(feeds, arrays)))))), names


def _as_seen(graph) -> dict[str, str]:
    """``{tensor: its QuantizeLinear -> DequantizeLinear output}``: the value the next layers really get.

    The raw tensor can differ from it by more than rounding: a quantizer that fuses ``Conv -> Relu``
    leaves the Conv's unclipped output there and lets the quantization range do the clipping.
    """
    dequantized = {n.input[0]: n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    return {n.input[0]: dequantized[n.output[0]] for n in graph.node
            if n.op_type == "QuantizeLinear" and n.output[0] in dequantized}


@dataclass
class SearchStep:
    """One exclusion: the node left in FP32, its score, and the check after it."""

    node: str
    score: float
    agreement: float
    relative_error: float
    accuracy_int8: float | None


@dataclass
class SearchOutcome:
    """Where the search stopped: the last model built, the nodes it left in FP32, its check's figures (an
    :class:`Agreement`, or what the caller's check returns) and what it still missed."""

    path: Path
    excluded: list[str]
    result: Agreement | Any
    missed: list[str]
    steps: list[SearchStep | Any] = field(default_factory=list)


def search(build: Callable[[list[str]], Path], check: Callable[[Path], tuple[Any, list[str]]],
           rank: Callable[[Path, list[str]], list[tuple[str, float]]], *, max_excluded: int,
           first: tuple[Path, Any, list[str]], record: Callable[[str, float, Any], Any] | None = None,
           ) -> SearchOutcome:
    """Exclude the worst-scored node, rebuild and re-check, until the check passes or ``max_excluded`` is reached.

    Args:
        build: writes the model with the given nodes left in FP32 (on top of the fixed ones) and returns its path.
        check: the check of a built model: its figures (an :class:`Agreement` by default) and what it missed
            (empty: passed).
        rank: scores of the nodes still quantized in a built model, worst first, given those already excluded.
        max_excluded: most nodes to leave in FP32.
        first: the model before any exclusion, with its check.
        record: ``(node, score, figures after it) -> step`` for ``steps``; a :class:`SearchStep` of an
            :class:`Agreement` when not given.

    Returns:
        the :class:`SearchOutcome`.
    """
    path, result, missed = first
    outcome = SearchOutcome(path, [], result, missed)
    while outcome.missed and len(outcome.excluded) < max_excluded:
        ranking = [(n, s) for n, s in rank(outcome.path, outcome.excluded) if n not in outcome.excluded]
        if not ranking:
            break
        node, score = ranking[0]
        outcome.excluded.append(node)
        outcome.path = build(list(outcome.excluded))
        outcome.result, outcome.missed = check(outcome.path)
        outcome.steps.append((record or _agreement_step)(node, score, outcome.result))
    return outcome


def _agreement_step(node: str, score: float, result: Agreement) -> SearchStep:
    return SearchStep(node, round(score, 6), result.agreement, result.relative_error, result.accuracy_int8)
