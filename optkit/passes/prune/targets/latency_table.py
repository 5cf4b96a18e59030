"""A per-layer latency lookup table: how long each conv/linear layer takes at other channel counts.

Each conv/linear layer of a model is timed alone in ONNX Runtime (a one-node
graph with the layer's real input size, kernel, stride, padding, dilation and
groups) at a coarse grid of input and output channel counts (multiples of
``step`` from about a quarter of the width to the full width); widths between
grid points are interpolated bilinearly. Entries are cached on disk per
machine (CPU model, core count, ONNX Runtime version), threads and batch,
keyed by the layer's signature, so layers alike (and a second build) cost no
measurement.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

#: Fractions of a layer's width timed on each axis (rounded to multiples of ``step``).
GRID_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


@dataclass
class LayerEntry:
    """One layer's timings.

    Attributes:
        signature: what the timing depends on (kind, widths, kernel, stride, padding, dilation, groups,
            input size); layers with equal signatures share the entry.
        in_channels, out_channels: the layer's full widths.
        in_grid, out_grid: the channel counts timed on each axis (one value for a depthwise conv's
            input axis, whose input width follows its output width).
        ms: ``ms[i][j]`` is the median latency at ``in_grid[i]`` inputs and ``out_grid[j]`` outputs.
        macs: the layer's MACs per sample at full width.
        depthwise: inputs, outputs and groups are one number that shrinks together.
    """

    signature: str
    in_channels: int
    out_channels: int
    in_grid: list[int]
    out_grid: list[int]
    ms: list[list[float]]
    macs: int
    depthwise: bool = False


@dataclass
class LatencyTable:
    """Per-layer timings of one model at one thread count and batch.

    Attributes:
        layers: layer name -> :class:`LayerEntry`.
        threads, batch: how the layers were timed.
        cost: ``seconds`` to build, ``measurements`` made and ``cache_hits``.
    """

    layers: dict[str, LayerEntry]
    threads: int
    batch: int
    cost: dict[str, float] = field(default_factory=dict)


def machine_key() -> str:
    """The machine a timing belongs to: CPU model, core count and ONNX Runtime version."""
    import onnxruntime as ort

    from optkit.analysis.latency import cpu_model

    return f"{cpu_model()}|{os.cpu_count()}|ort{ort.__version__}"


def build_table(model: nn.Module, input_shape: tuple[int, ...], *, threads: int | None = None, batch: int = 1,
                step: int = 8, repeats: int = 7) -> LatencyTable:
    """Time every conv/linear layer of ``model`` alone at a grid of channel counts (cached on disk).

    Args:
        model: the model; one forward pass at ``input_shape`` finds each layer's input size.
        input_shape: the model's input shape (its batch is replaced by ``batch``).
        threads: ONNX Runtime intra-op threads (``None``: all cores).
        batch: the batch each layer is timed at.
        step: grid channel counts are multiples of this.
        repeats: timed calls per grid point (the median is kept).

    Returns:
        the table, with its ``cost``.
    """
    from optkit.core.files import cache_dir, write_text

    start = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    key = f"{machine_key()}|threads{threads}|batch{batch}|step{step}"
    path = cache_dir() / "latency_table" / f"{_digest(key)}.json"
    cached: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    measurements = hits = 0
    layers: dict[str, LayerEntry] = {}
    for name, spec in layer_specs(model, input_shape, batch).items():
        signature = json.dumps(spec, sort_keys=True)
        if signature in cached:
            hits += 1
        else:
            cached[signature] = _time_layer(spec, threads, step, repeats)
            measurements += len(cached[signature]["ms"]) * len(cached[signature]["ms"][0])
        entry = cached[signature]
        layers[name] = LayerEntry(signature, spec["in"], spec["out"], entry["in_grid"], entry["out_grid"],
                                  entry["ms"], spec["macs"], spec["depthwise"])
    if measurements:
        write_text(path, json.dumps({"machine": key, **cached}, sort_keys=True))
    cost = {"seconds": round(time.perf_counter() - start, 3), "measurements": measurements, "cache_hits": hits}
    return LatencyTable(layers, threads, batch, cost)


def predict(table: LatencyTable, widths: Mapping[str, tuple[int, int]] | None = None) -> float:
    """Predicted milliseconds of the table's layers at ``widths`` (layer name -> (in, out) channels).

    Layers not named run at full width; the sum covers conv/linear layers only.
    """
    widths = widths or {}
    return sum(layer_ms(entry, *widths.get(name, (entry.in_channels, entry.out_channels)))
               for name, entry in table.layers.items())


def layer_ms(entry: LayerEntry, in_channels: int, out_channels: int) -> float:
    """One layer's interpolated milliseconds at ``in_channels`` inputs and ``out_channels`` outputs."""
    if entry.depthwise:
        return _interp(entry.out_grid, entry.ms[0], out_channels)
    row = [_interp(entry.out_grid, line, out_channels) for line in entry.ms]
    return _interp(entry.in_grid, row, in_channels)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points, extended linearly beyond the ends (floored at 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = next((k for k in range(1, len(xs) - 1) if x < xs[k]), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _grid(width: int, step: int) -> list[int]:
    return sorted({min(width, max(step, round(width * f / step) * step)) for f in GRID_FRACTIONS} | {width})


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layer_specs(model: nn.Module, input_shape: tuple[int, ...], batch: int = 1) -> dict[str, dict[str, Any]]:
    """Each conv/linear layer's signature, found by a forward pass with hooks.

    Returns:
        layer name -> ``kind``, ``in``, ``out`` (channels), ``macs`` per sample, ``depthwise``, the
        input ``shape`` (with ``batch``) and, for convs, kernel, stride, padding, dilation and groups.
    """
    import torch
    from torch import nn

    from optkit.model.inputs import example_input
    from optkit.model.state import eval_mode
    from optkit.model.stats import prunable_weights

    specs: dict[str, dict[str, Any]] = {}

    def hook(name):
        def record(module, args, output):
            shape = [batch, *args[0].shape[1:]]
            per_sample = output[0].numel() if output.dim() > 1 else output.numel()
            if isinstance(module, nn.Linear):
                spec = {"kind": "linear", "in": module.in_features, "out": module.out_features}
                macs = per_sample * module.in_features
            else:
                spec = {"kind": "conv", "in": module.in_channels, "out": module.out_channels,
                        "kernel": list(module.kernel_size), "stride": list(module.stride),
                        "padding": list(module.padding) if not isinstance(module.padding, str) else module.padding,
                        "dilation": list(module.dilation), "groups": module.groups}
                macs = per_sample * module.in_channels // module.groups * int(torch.tensor(module.kernel_size).prod())
            depthwise = spec.get("groups", 1) == spec["in"] == spec["out"] and spec["in"] > 1
            specs.setdefault(name, {**spec, "shape": shape, "bias": module.bias is not None,
                                    "depthwise": depthwise, "macs": int(macs)})
        return record

    hooks = [m.register_forward_hook(hook(n)) for n, m in prunable_weights(model)
             if isinstance(m, (nn.Linear, nn.Conv2d))]
    try:
        with eval_mode(model), torch.no_grad():
            model(example_input(model, (1, *input_shape[1:])))
    finally:
        for h in hooks:
            h.remove()
    return specs


def _time_layer(spec: dict[str, Any], threads: int, step: int, repeats: int) -> dict[str, Any]:
    """Time one layer signature at its channel grid: ``{in_grid, out_grid, ms}``."""
    import numpy as np

    from optkit.analysis.latency import time_callable
    from optkit.runtime.onnxrt import onnx_session

    out_grid = _grid(spec["out"], step)
    in_grid = [spec["in"]] if spec["depthwise"] else _grid(spec["in"], step)
    groups = spec.get("groups", 1)
    if groups > 1 and not spec["depthwise"]:
        # Grouped (not depthwise) convs keep their group count: widths must stay multiples of it.
        out_grid = sorted({max(groups, c // groups * groups) for c in out_grid})
        in_grid = sorted({max(groups, c // groups * groups) for c in in_grid})
    ms: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="optkit-lut-") as folder:
        path = os.path.join(folder, "layer.onnx")
        for cin in in_grid:
            row = []
            for cout in out_grid:
                shape = _write_layer(path, spec, cout if spec["depthwise"] else cin, cout)
                session = onnx_session(path, threads, spinning=True)
                feed = {session.get_inputs()[0].name: np.random.default_rng(0).standard_normal(shape,
                                                                                             dtype=np.float32)}
                timing = time_callable(lambda: session.run(None, feed), warmup=2, repeats=repeats)
                del session
                row.append(round(timing["median_ms"], 5))
            ms.append(row)
    return {"in_grid": in_grid, "out_grid": out_grid, "ms": ms}


def _write_layer(path: str, spec: dict[str, Any], cin: int, cout: int) -> list[int]:
    """Write a one-layer ONNX model at ``cin``/``cout`` channels; returns its input shape."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    shape = list(spec["shape"])
    if spec["kind"] == "linear":
        shape[-1] = cin
        weight = numpy_helper.from_array(rng.standard_normal((cin, cout), dtype=np.float32), "w")
        bias = numpy_helper.from_array(rng.standard_normal(cout, dtype=np.float32), "b")
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
        inits = [weight, bias]
    else:
        shape[1] = cin
        groups = cout if spec["depthwise"] else spec["groups"]
        kernel = spec["kernel"]
        weight = numpy_helper.from_array(
            rng.standard_normal((cout, cin // groups, *kernel), dtype=np.float32), "w")
        inits = [weight, numpy_helper.from_array(rng.standard_normal(cout, dtype=np.float32), "b")]
        attrs: dict[str, Any] = {"kernel_shape": kernel, "strides": spec["stride"], "dilations": spec["dilation"],
                                 "group": groups}
        if isinstance(spec["padding"], str):
            attrs["auto_pad"] = "SAME_UPPER" if spec["padding"] == "same" else "VALID"
        else:
            attrs["pads"] = spec["padding"] * 2
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return shape
