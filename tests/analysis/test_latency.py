"""optkit bench: latency in PyTorch eager and ONNX Runtime, with the spread reported (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.analysis import latency as bench
from optkit.cli import main
from optkit.core.errors import OptkitError


def tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx")
    model = tiny().eval()
    x = torch.randn(1, 3, 16, 16)
    dynamic, fixed = folder / "dynamic.onnx", folder / "fixed.onnx"
    torch.onnx.export(model, (x,), dynamic, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    torch.onnx.export(model, (x,), fixed, dynamo=False, input_names=["x"])
    return {"dynamic": dynamic, "fixed": fixed}


def check(result: bench.Latency, engine: str, shape: tuple[int, ...], repeats: int) -> None:
    assert result.engine == engine
    assert result.input_shape == shape and result.batch_size == shape[0]
    assert result.repeats == repeats
    assert 0 < result.min_ms <= result.median_ms <= result.p90_ms <= result.max_ms
    assert result.spread == pytest.approx(result.p90_ms / result.median_ms)
    assert result.throughput == pytest.approx(shape[0] * 1000 / result.median_ms)


def test_torch_batch_sizes_and_threads_restored():
    before = torch.get_num_threads()
    model = tiny().train()
    results = bench.bench_torch(model, (1, 3, 16, 16), batch_sizes=[1, 3], threads=1, warmup=1, repeats=4)
    assert model.training
    assert [r.batch_size for r in results] == [1, 3]
    for r in results:
        check(r, "torch", (r.batch_size, 3, 16, 16), 4)
        assert r.threads == 1 and r.device == "cpu"
    assert torch.get_num_threads() == before


def test_torch_wrong_shape_is_a_clear_error():
    with pytest.raises(OptkitError, match="does not run on input shape 1,5,16,16"):
        bench.bench_torch(tiny(), (1, 5, 16, 16), warmup=0, repeats=1)


def test_torch_cuda_unavailable_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(OptkitError, match="CUDA is not available"):
        bench.bench_torch(tiny(), (1, 3, 16, 16), device="cuda", repeats=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_on_cuda():
    (result,) = bench.bench_torch(tiny(), (2, 3, 16, 16), device="cuda", warmup=1, repeats=3)
    check(result, "torch", (2, 3, 16, 16), 3)


def test_counts_are_validated():
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.bench_torch(tiny(), (1, 3, 16, 16), repeats=0)


def test_onnx_dynamic_batch(onnx_files):
    results = bench.bench_onnx(onnx_files["dynamic"], batch_sizes=[1, 2], threads=1, warmup=1, repeats=3)
    assert [r.input_shape for r in results] == [(1, 3, 16, 16), (2, 3, 16, 16)]
    for r in results:
        check(r, "onnxruntime", r.input_shape, 3)
    (default,) = bench.bench_onnx(onnx_files["dynamic"], warmup=0, repeats=1)
    assert default.input_shape == (1, 3, 16, 16)


def test_onnx_fixed_batch(onnx_files):
    (result,) = bench.bench_onnx(onnx_files["fixed"], warmup=0, repeats=2)
    check(result, "onnxruntime", (1, 3, 16, 16), 2)
    assert result.threads is None
    with pytest.raises(OptkitError, match="fixed batch of 1"):
        bench.bench_onnx(onnx_files["fixed"], batch_sizes=[4], repeats=1)


def test_onnx_unreadable_file(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not onnx")
    with pytest.raises(OptkitError, match="ONNX Runtime cannot load it"):
        bench.bench_onnx(path, repeats=1)


def latency(engine: str, batch: int, median: float, spread: float = 1.05) -> bench.Latency:
    return bench.Latency(engine, "cpu", batch, (batch, 3), 1, median, median * spread, median, median * spread,
                         spread, 5, 1, batch * 1000 / median)


def test_compare_ratio_and_noise():
    a = [latency("torch", 1, 10.0), latency("torch", 8, 40.0), latency("onnxruntime", 1, 5.0)]
    b = [latency("torch", 1, 5.0), latency("torch", 8, 39.0)]
    pairs = bench.compare(a, b)
    assert [(p["engine"], p["batch_size"]) for p in pairs] == [("torch", 1), ("torch", 8)]
    assert pairs[0]["speedup"] == pytest.approx(2.0) and not pairs[0]["noisy"]
    assert pairs[1]["speedup"] == pytest.approx(40 / 39) and pairs[1]["noisy"]


def test_cli_model_and_onnx_json(onnx_files):
    runner = CliRunner()
    result = runner.invoke(main, ["bench", str(onnx_files["dynamic"]), "--batch-size", "1", "--batch-size", "2",
                                  "--repeats", "2", "--warmup", "0", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"][str(onnx_files["dynamic"])]
    assert [(r["engine"], r["batch_size"]) for r in rows] == [("onnxruntime", 1), ("onnxruntime", 2)]
    assert all(r["spread"] >= 1.0 for r in rows)


def test_cli_compare_prints_both_and_the_ratio():
    result = CliRunner().invoke(main, ["bench", "--compare", "torchvision:squeezenet1_1", "torchvision:squeezenet1_1",
                                       "--num-classes", "10", "--input-shape", "1,3,32,32", "--threads", "1",
                                       "--repeats", "3", "--warmup", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.count("torchvision:squeezenet1_1") >= 2
    assert "A / B = " in result.output and "spread" in result.output


def test_cli_needs_exactly_one_model_or_compare():
    runner = CliRunner()
    assert "give one MODEL, or --compare A B" in runner.invoke(main, ["bench"]).output
    result = runner.invoke(main, ["bench", "torchvision:resnet18", "--compare", "a", "b"])
    assert result.exit_code == 2 and "give one MODEL, or --compare A B" in result.output


def test_onnx_file_runs_only_in_onnxruntime(onnx_files):
    result = CliRunner().invoke(main, ["bench", str(onnx_files["fixed"]), "--engine", "torch"])
    assert result.exit_code == 2 and "runs only with --engine onnxruntime" in result.output


def test_torch_model_in_both_engines():
    result = CliRunner().invoke(main, ["bench", "torchvision:squeezenet1_1", "--num-classes", "10", "--input-shape",
                                       "1,3,32,32", "--engine", "torch", "--engine", "onnxruntime", "--batch-size", "1",
                                       "--batch-size", "2", "--repeats", "2", "--warmup", "0", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]["torchvision:squeezenet1_1"]
    assert [(r["engine"], r["batch_size"]) for r in rows] == [("torch", 1), ("torch", 2), ("onnxruntime", 1),
                                                               ("onnxruntime", 2)]


SHIPPED = "optkit/demo/fashion_resnet.pt"


def test_compare_of_models_that_take_different_inputs_is_refused_before_timing(monkeypatch):
    """#31: a 224x224 ImageNet model against the 28x28 Fashion model printed "B is faster" without a word."""
    timed = []
    monkeypatch.setattr(bench, "bench_torch", lambda *args, **kwargs: timed.append(args) or [])
    result = CliRunner().invoke(main, ["bench", "--compare", "torchvision:resnet18", SHIPPED])
    assert result.exit_code == 1 and timed == []
    assert result.output == (f"Error: A (torchvision:resnet18) takes 3x224x224 inputs but B ({SHIPPED}) takes 1x28x28, "
                             "so their times are not comparable; compare models of the same input, or give an "
                             "--input-shape both take\n")


def test_compare_of_onnx_files_of_different_inputs_is_refused(onnx_files, tmp_path):
    other = tmp_path / "wide.onnx"
    torch.onnx.export(tiny().eval(), (torch.randn(1, 3, 24, 24),), other, dynamo=False, input_names=["x"])
    result = CliRunner().invoke(main, ["bench", "--compare", str(onnx_files["fixed"]), str(other),
                                       "--repeats", "1", "--warmup", "0"])
    assert result.exit_code == 1 and "takes 3x16x16 inputs but B" in result.output and "takes 3x24x24" in result.output


def test_compare_of_the_shipped_model_and_its_pruned_copy_prints_the_ratio(tmp_path):
    pruned = tmp_path / "pruned"
    assert CliRunner().invoke(main, ["optimize", SHIPPED, "--prune", "0.3", "--out", str(pruned)]).exit_code == 0
    result = CliRunner().invoke(main, ["bench", "--compare", SHIPPED, str(pruned / "model.pt"), "--threads", "1",
                                       "--repeats", "3", "--warmup", "1"])
    assert result.exit_code == 0, result.output
    assert "torch batch 1: A / B = " in result.output and "1×1×28×28" in result.output
