"""Single nodes whose INT8 kernels are slower than FP32 stay FP32: the profiler's traces and the timed decision."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from optkit.passes.quantize import Int8Settings, optypes, quantize_onnx, static
from optkit.passes.quantize.profile import _resolver, node_times

SHAPE = (1, 3, 32, 32)
DATA = "synthetic:64:3x32x32:10"
COMPUTE = ["/convs.0/Conv", "/convs.1/Conv", "/convs.2/Conv", "/head/Gemm"]


def _fp32_nodes(path) -> set[str]:
    """Conv/Gemm nodes that read no dequantized input: those that run in FP32."""
    graph = onnx.load(str(path)).graph
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in graph.node if n.op_type in ("Conv", "Gemm") and not any(i in dq for i in n.input)}


def _build(folder: Path):
    """A stand-in for the quantizer: an empty file whose name lists the nodes left in FP32."""
    def build(excluded):
        path = folder / ("fp32=" + "+".join(sorted(n.strip("/").replace("/", "_") for n in excluded)) + ".onnx")
        path.touch()
        return path

    return build


def _fp32_in(path: Path, node: str) -> bool:
    return node.strip("/").replace("/", "_") in path.name


# --- the decision, with stand-in profiles and timings ---------------------------------------------------------

FP32_MS = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.10}
INT8_MS = {"a": 3.0, "b": 1.5, "c": 0.4, "d": 0.11}  # traced INT8 total 5.01: a is 2.0 slower, b 0.5, d 0.01


def _profiler(fp32_path: Path):
    return lambda path: FP32_MS if path == fp32_path else INT8_MS


def test_nodes_clearly_slower_in_int8_are_tried_together_and_kept_when_the_model_gets_faster(tmp_path):
    build, fp32 = _build(tmp_path), tmp_path / "fp32.onnx"

    def timer(paths):
        return [5.0 - 2.0 * _fp32_in(p, "a") - 0.5 * _fp32_in(p, "b") for p in paths]

    nodes, gain = optypes.slow_nodes(fp32, build(()), (), build, timer, _profiler(fp32))
    assert nodes == ["a", "b"], "worst first; d's 0.01 ms is below the share that pays for its borders"
    assert gain == pytest.approx(5.0 / 2.5, abs=1e-3)


def test_the_worst_node_alone_is_tried_when_all_together_are_not_faster(tmp_path):
    build, fp32 = _build(tmp_path), tmp_path / "fp32.onnx"

    def timer(paths):  # leaving b in FP32 costs conversions that outweigh its gain
        return [5.0 - 2.0 * _fp32_in(p, "a") + 3.0 * _fp32_in(p, "b") for p in paths]

    nodes, gain = optypes.slow_nodes(fp32, build(()), (), build, timer, _profiler(fp32))
    assert nodes == ["a"] and gain == pytest.approx(5.0 / 3.0, abs=1e-3)


def test_nothing_changes_when_timing_does_not_confirm_the_profile(tmp_path):
    build, fp32 = _build(tmp_path), tmp_path / "fp32.onnx"
    calls = []

    def timer(paths):
        calls.append(paths)
        return [5.0 for _ in paths]

    assert optypes.slow_nodes(fp32, build(()), (), build, timer, _profiler(fp32)) == ([], pytest.approx(1.0))
    assert len(calls) == 2, "together, then the worst alone"


def test_nodes_already_in_fp32_are_not_tried_again(tmp_path):
    build, fp32 = _build(tmp_path), tmp_path / "fp32.onnx"

    def timer(paths):
        return [5.0 - 0.5 * _fp32_in(p, "b") for p in paths]

    nodes, _ = optypes.slow_nodes(fp32, build(["a"]), ["a"], build, timer, _profiler(fp32))
    assert nodes == ["b"]


# --- the whole path, on the small CNN ---------------------------------------------------------------------------

def _slow_stem_profile(fp32_path: Path):
    """The stem conv's INT8 kernel three times as slow as its FP32 one; every other node twice as fast."""
    def profiler(path: Path):
        if path == fp32_path:
            return dict.fromkeys(COMPUTE, 0.1)
        return {n: 0.3 if n == COMPUTE[0] else 0.05 for n in COMPUTE}
    return profiler


def _stem_costs(paths):
    """1 ms, 0.2 ms less with the stem in FP32 (it is INT8 in the quantized files unless excluded)."""
    return [1.0 - 0.2 * (COMPUTE[0] in _fp32_nodes(p) and COMPUTE[1] not in _fp32_nodes(p)) for p in paths]


def test_quantize_leaves_the_slow_node_in_fp32_says_so_and_caches_it(models, tmp_path, out):
    settings = Int8Settings(calib_data=DATA, min_agreement=0.95, max_accuracy_drop=0.05)
    cache = tmp_path / "cache.json"
    seen = []

    def profiler(path):
        seen.append(Path(path))
        return _slow_stem_profile(seen[0])(path)

    result = quantize_onnx(models["plain"], out, settings, input_shape=SHAPE, timer=_stem_costs, profiler=profiler,
                           cache_path=cache)
    assert result.fp32_nodes == [COMPUTE[0]] and result.fp32_op_types == []
    assert result.op_gains["nodes"] == pytest.approx(1.0 / 0.8, abs=1e-3)
    assert _fp32_nodes(out) == {COMPUTE[0]}
    assert any("1 node(s) kept in FP32" in note and COMPUTE[0] in note for note in result.notes)

    def no_timing(paths):
        raise AssertionError("the cached verdict should have been used")

    again = quantize_onnx(models["plain"], out, settings, input_shape=SHAPE, timer=no_timing, profiler=no_timing,
                          cache_path=cache)
    assert again.op_gains_cached and again.fp32_nodes == [COMPUTE[0]] and _fp32_nodes(out) == {COMPUTE[0]}


# --- tracing ONNX Runtime's kernels back to the graph's nodes ---------------------------------------------------

def test_profiles_of_the_fp32_and_int8_models_trace_every_compute_node(models, tmp_path):
    from optkit.passes.quantize.calibration import load_batches

    pre, int8 = tmp_path / "pre.onnx", tmp_path / "int8.onnx"
    static.preprocess(models["plain"], pre)
    calibration = load_batches(DATA, "train", (4, *SHAPE[1:]), batch_size=4, samples=16)
    static.quantize_file(pre, int8, mode="static", method="minmax", per_channel=True, op_types=["Conv", "Gemm", "Relu"],
                         exclude=[], calibration=calibration, cache_path=None)
    for path in (pre, int8):
        times = node_times(path, pre, COMPUTE, SHAPE, threads=1, runs=5, warmup=2)
        assert set(times) == set(COMPUTE), path.name
        assert all(0 < ms < 100 for ms in times.values())


def _graph(path: Path) -> Path:
    """x -> Conv c1 -> Relu -> y1; y1 -> Conv c2 -> z2; Add(y1, z2) -> Relu -> out; Add(z2, Conv c3(x)) -> out2."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 1, 1], [1.0])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1_out"], name="c1"),
             helper.make_node("Relu", ["c1_out"], ["y1"], name="relu1"),
             helper.make_node("Conv", ["y1", "w"], ["z2"], name="c2"),
             helper.make_node("Add", ["y1", "z2"], ["sum"], name="add"),
             helper.make_node("Relu", ["sum"], ["out"], name="relu2"),
             helper.make_node("Conv", ["x", "w"], ["z3"], name="c3"),
             helper.make_node("Add", ["z2", "z3"], ["out2"], name="add2")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                              [info("out", TensorProto.FLOAT, None), info("out2", TensorProto.FLOAT, None)], [weight])
    onnx.save(helper.make_model(graph), str(path))
    return path


@pytest.mark.parametrize(("kernel", "node"), [
    ("c2", "c2"),                    # kept its name
    ("c1_token_3", "c1"),            # a QDQ group fused into one integer node
    ("y1_nchwc", "c1"),              # a blocked conv named after the activation fused into it
    ("out_nchwc", "c2"),             # conv + residual add + activation: the add's other input is one step further back
    ("out2_nchwc", None),            # two convs equally near: ambiguous, left out
    ("ReorderOutput_7", None),       # not a tensor or node of the graph
])
def test_kernel_names_resolve_to_the_node_they_stand_for(tmp_path, kernel, node):
    assert _resolver(_graph(tmp_path / "g.onnx"), {"c1", "c2", "c3"})(kernel) == node
