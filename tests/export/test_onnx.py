"""optkit.export.onnx: every export is verified, a mismatch raises and leaves no file."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision
from click.testing import CliRunner
from torch import nn
from torch.nn.utils import prune

from optkit.io import checkpoint

from optkit.export import onnx as export
from optkit.cli import main
from optkit.core.errors import ExportError
from optkit.export.onnx import export_onnx, prepare_for_export
from optkit.io.models import torchvision_names
from optkit.passes.prune.passes import L1Unstructured, StructuredPrune

SMALL = (1, 3, 64, 64)


def _run_onnx(path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _with_live_outputs(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    """Make a random-init model's eval outputs large enough for the export check to compare something.

    torchvision zero-initializes some heads (ViT), and with default BatchNorm
    statistics many deep CNNs (EfficientNet, MobileNet, MNASNet) output about
    1e-13 in eval mode, which any export matches within the absolute
    tolerance. So all-zero linear layers get random weights and BatchNorm
    statistics are taken from two random batches, as a trained model's would be.
    """
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.Linear) and not module.weight.any():
            nn.init.normal_(module.weight, std=0.02)
            nn.init.normal_(module.bias, std=0.02)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()
            module.momentum = None
    with torch.no_grad():
        for seed in range(2):
            model(torch.randn(4, *shape[1:], generator=torch.Generator().manual_seed(seed)))
    return model.eval()


def _small_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=2,
                                                hidden_dim=64, mlp_dim=128, num_classes=10)


def _vgg_features() -> nn.Module:
    # vgg11_bn's conv stack with a small head: the full 4096-wide classifier makes a
    # 200 MB file, which the slow test over the full list exports instead.
    model = torchvision.models.vgg11_bn(num_classes=10)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))
    return model


# One model per family, pruned at 0.3 and exported at a small input.
FAMILIES = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),
    "vgg11_bn": _vgg_features,
    "mobilenet_v2": lambda: torchvision.models.mobilenet_v2(num_classes=10),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(num_classes=10),
    "densenet": lambda: torchvision.models.DenseNet(growth_rate=16, block_config=(2, 3, 4), num_init_features=32,
                                                    num_classes=10),
    "squeezenet1_1": lambda: torchvision.models.squeezenet1_1(num_classes=10),
    "regnet_x_400mf": lambda: torchvision.models.regnet_x_400mf(num_classes=10),
    "convnext_tiny": lambda: torchvision.models.convnext_tiny(num_classes=10),
    "vit": _small_vit,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exports_and_verifies_after_structured_prune(family, tmp_path):
    torch.manual_seed(0)
    model = _with_live_outputs(FAMILIES[family](), SMALL)
    params_before = sum(p.numel() for p in model.parameters())
    StructuredPrune(ratio=0.3, input_shape=SMALL)(model)
    assert sum(p.numel() for p in model.parameters()) < params_before

    result = export_onnx(model, tmp_path / "m.onnx", SMALL)

    assert result.exporter in ("torchscript", "dynamo")
    assert [v.batch_size for v in result.verification] == [1, 3]
    assert all(v.passed and v.max_abs_diff <= 1e-3 * v.max_abs_ref for v in result.verification)
    x = torch.randn(5, *SMALL[1:])
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    np.testing.assert_allclose(_run_onnx(tmp_path / "m.onnx", x), expected, rtol=0, atol=1e-3 * np.abs(expected).max())
    assert os.listdir(tmp_path) == ["m.onnx"]


def _classification_shape(name: str) -> tuple[int, ...]:
    if name.startswith(("vit_", "swin", "maxvit")):
        return (1, 3, 224, 224)
    if name == "inception_v3":
        return (1, 3, 160, 160)
    return SMALL


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the slowest, vit_h_14, took 120 s on a quiet 2-core machine; loaded runs took minutes
@pytest.mark.parametrize("name", torchvision_names())
def test_every_classification_model_exports_after_structured_prune(name, tmp_path):
    shape = _classification_shape(name)
    torch.manual_seed(0)
    model = _with_live_outputs(torchvision.models.get_model(name, num_classes=10), shape)
    StructuredPrune(ratio=0.3, input_shape=shape)(model)
    result = export_onnx(model, tmp_path / "m.onnx", shape)
    assert all(v.passed and v.max_abs_ref > v.tolerance for v in result.verification)


class ExportsDifferently(nn.Module):
    """Scales its output only while being exported: a graph that does not match eager PyTorch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        if torch.onnx.is_in_onnx_export():
            y = y * 1.01
        return y


class WrongSymbolic(torch.autograd.Function):
    """Eager: relu. Exported (TorchScript symbolic): sigmoid."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(min=0)

    @staticmethod
    def symbolic(g, x):
        return g.op("Sigmoid", x)


class WithWrongSymbolic(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return WrongSymbolic.apply(self.conv(x))


@pytest.mark.parametrize("model_cls", [ExportsDifferently, WithWrongSymbolic])
def test_mismatching_export_raises_and_leaves_no_file(model_cls, tmp_path):
    with pytest.raises(ExportError, match="differ from PyTorch at batch size 1"):
        export_onnx(model_cls(), tmp_path / "bad.onnx", (1, 3, 16, 16), exporter="torchscript")
    assert os.listdir(tmp_path) == []


def test_mismatch_keeps_an_existing_file_unchanged(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"previous")
    with pytest.raises(ExportError):
        export_onnx(ExportsDifferently(), target, (1, 3, 16, 16), exporter="torchscript")
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["model.onnx"]


@pytest.mark.slow
def test_auto_reports_both_exporters_when_neither_matches(tmp_path):
    with pytest.raises(ExportError) as info:
        export_onnx(ExportsDifferently(), tmp_path / "bad.onnx", (1, 3, 16, 16))
    assert "torchscript: ONNX Runtime outputs differ" in str(info.value)
    assert "dynamo: ONNX Runtime outputs differ" in str(info.value)
    assert os.listdir(tmp_path) == []


_REAL_RUN = ort.InferenceSession.run


def _shifted_run(shift: float):
    """An ``InferenceSession.run`` whose outputs are all moved by ``shift`` (a stand-in for a wrong export)."""
    return lambda self, *a, **k: [out + np.float32(shift) for out in _REAL_RUN(self, *a, **k)]


def test_mismatch_is_judged_relative_to_output_magnitude(tmp_path, monkeypatch):
    # Outputs near 1e4 (like huge random-init logits): a 1e-2 absolute difference is
    # fine at rtol 1e-3, and a difference of 2e-3 relative is not.
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    with torch.no_grad():
        model[1].bias.fill_(1e4)
    monkeypatch.setattr(ort.InferenceSession, "run", _shifted_run(1e-2))
    result = export_onnx(model, tmp_path / "ok.onnx", (1, 3, 2, 2), exporter="torchscript")
    assert 9e-3 < result.verification[0].max_abs_diff < 1.1e-2
    monkeypatch.setattr(ort.InferenceSession, "run", _shifted_run(20.0))
    with pytest.raises(ExportError, match=r"max \|diff\| 20 "):
        export_onnx(model, tmp_path / "bad.onnx", (1, 3, 2, 2), exporter="torchscript")
    assert os.listdir(tmp_path) == ["ok.onnx"]


def test_falls_back_to_the_other_exporter_and_reports_why(tmp_path, monkeypatch):
    real = export._run_exporter

    def torchscript_broken(model, path, shape, exporter, **kwargs):
        if exporter == "torchscript":
            raise RuntimeError("simulated exporter failure")
        return real(model, path, shape, exporter, **kwargs)

    monkeypatch.setattr(export, "_run_exporter", torchscript_broken)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 16, 16))
    assert result.exporter == "dynamo" and result.batchnorm_nodes == 0
    assert "simulated exporter failure" in result.attempts["torchscript"]
    assert any("exported with dynamo" in note for note in result.notes)
    assert _run_onnx(tmp_path / "m.onnx", torch.randn(4, 3, 16, 16)).shape == (4, 8)


def test_input_model_is_left_unchanged(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    model.train()
    export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8))
    assert model.training
    assert hasattr(model[0], "weight_orig") and hasattr(model[0], "weight_mask")


def test_prepare_removes_pruning_reparametrization_and_wrappers():
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def optkit_unwrap(self):
            return self.inner

        def forward(self, x):
            return self.inner(x)

    inner = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    prune.l1_unstructured(inner[0], "weight", amount=0.5)
    prepared = prepare_for_export(Wrapper(inner).train())
    assert isinstance(prepared, nn.Sequential) and not prepared.training
    assert "weight" in dict(prepared[0].named_parameters())
    assert not hasattr(prepared[0], "weight_mask") and not prepared[0]._forward_pre_hooks
    assert float((prepared[0].weight == 0).float().mean()) == pytest.approx(0.5, abs=0.01)


def test_batchnorm_is_folded_into_conv_by_the_export(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 16, 16), exporter="torchscript")
    assert result.batchnorm_nodes == 0
    ops = {node.op_type for node in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "BatchNormalization" not in ops and "Conv" in ops


def test_unstructured_sparsity_shrinks_only_the_compressed_size(tmp_path):
    torch.manual_seed(0)
    dense = torchvision.models.squeezenet1_1(num_classes=10)
    sparse = L1Unstructured(ratio=0.5)(copy.deepcopy(dense))
    before = export_onnx(dense, tmp_path / "dense.onnx", SMALL)
    after = export_onnx(sparse, tmp_path / "sparse.onnx", SMALL)
    assert after.file_size == pytest.approx(before.file_size, rel=0.01)
    assert after.compressed_size < 0.8 * before.compressed_size
    assert before.weight_sparsity == 0 and after.weight_sparsity == pytest.approx(0.5, abs=0.01)
    assert not before.notes
    assert any("run no faster on zeros" in note for note in after.notes)
    sizes_before, sizes_after = export.weights_sizes(dense), export.weights_sizes(sparse)
    assert sizes_after["weights"] == sizes_before["weights"]
    assert sizes_after["weights_gzip"] < 0.8 * sizes_before["weights_gzip"]


def test_all_zero_outputs_are_flagged_as_a_weak_check(tmp_path):
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    nn.init.zeros_(model[1].weight)
    nn.init.zeros_(model[1].bias)
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8))
    assert any("within the tolerance of zero" in note for note in result.notes)
    model[1].bias.data.fill_(1.0)
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8))
    assert not any("within the tolerance of zero" in note for note in result.notes)


def test_gzip_size_is_what_gzip_writes(tmp_path):
    import gzip

    data = bytes(range(256)) * 1000 + b"\0" * 50000
    (tmp_path / "f").write_bytes(data)
    assert export.gzip_size(tmp_path / "f") == len(gzip.compress(data, compresslevel=6, mtime=0))


def test_fp16_weights_halve_the_file_and_keep_fp32_io(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=10)
    full = export_onnx(model, tmp_path / "fp32.onnx", SMALL)
    half = export_onnx(model, tmp_path / "fp16.onnx", SMALL, fp16=True)
    assert half.fp16 and 0.45 < half.file_size / full.file_size < 0.55
    assert all(v.max_abs_diff <= 2e-2 * v.max_abs_ref for v in half.verification)
    graph = onnx.load(str(tmp_path / "fp16.onnx")).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert {i.data_type for i in graph.initializer if i.dims} == {onnx.TensorProto.FLOAT16}


def _initializer_types(path) -> set[int]:
    return {i.data_type for i in onnx.load(str(path)).graph.initializer if i.dims}


def test_fp16_with_simplify_still_stores_fp16_weights(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=10)
    full = export_onnx(model, tmp_path / "fp32.onnx", SMALL, simplify=True)
    half = export_onnx(model, tmp_path / "fp16.onnx", SMALL, fp16=True, simplify=True)
    assert half.fp16 and half.simplified and all(v.passed for v in half.verification)
    assert _initializer_types(tmp_path / "fp16.onnx") == {onnx.TensorProto.FLOAT16}
    assert 0.45 < half.file_size / full.file_size < 0.55


def test_fp16_file_that_kept_float32_weights_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "_store_weights_fp16", lambda proto: None)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    with pytest.raises(ExportError, match=r"fp16 was asked but the written file stores 2 float32 initializer"):
        export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8), fp16=True, exporter="torchscript")
    assert os.listdir(tmp_path) == []


def test_fp16_default_tolerance_is_two_percent_of_the_output_scale(tmp_path, monkeypatch):
    # Outputs near 100: ONNX Runtime's shifted by 1 (1%) pass the documented 2e-2, by 3 (3%) are refused.
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    with torch.no_grad():
        model[1].bias.fill_(100.0)
    monkeypatch.setattr(ort.InferenceSession, "run", _shifted_run(1.0))
    result = export_onnx(model, tmp_path / "ok.onnx", (1, 3, 2, 2), fp16=True, exporter="torchscript")
    for check in result.verification:
        assert check.tolerance == pytest.approx(0.02 * check.max_abs_ref, rel=1e-9)
        assert 95 < check.max_abs_ref < 105
    monkeypatch.setattr(ort.InferenceSession, "run", _shifted_run(3.0))
    with pytest.raises(ExportError, match=r"rtol 0.02 "):
        export_onnx(model, tmp_path / "bad.onnx", (1, 3, 2, 2), fp16=True, exporter="torchscript")


def test_metadata_is_written_as_metadata_props(tmp_path):
    metadata = {"optkit.mean": "0.286", "optkit.std": "0.353"}
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8), fp16=True, simplify=True, metadata=metadata)
    assert result.metadata == metadata
    assert {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props} == metadata
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map == metadata
    export_onnx(model, tmp_path / "plain.onnx", (1, 3, 8, 8))
    assert list(onnx.load(str(tmp_path / "plain.onnx")).metadata_props) == []


def test_metadata_must_be_strings(tmp_path):
    with pytest.raises(ValueError, match="metadata must map strings to strings"):
        export_onnx(nn.Flatten(), tmp_path / "m.onnx", (1, 3, 2, 2), metadata={"mean": 0.5})
    assert os.listdir(tmp_path) == []


def test_static_batch_fixes_the_batch_dimension(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    result = export_onnx(model, tmp_path / "m.onnx", (2, 3, 8, 8), dynamic_batch=False)
    assert [v.batch_size for v in result.verification] == [2, 2]
    dims = onnx.load(str(tmp_path / "m.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 3, 8, 8]


def test_dynamic_batch_runs_at_other_batch_sizes(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8))
    assert _run_onnx(tmp_path / "m.onnx", torch.randn(7, 3, 8, 8)).shape == (7, 144)


def test_external_data_file_is_written_and_verified(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 10))
    result = export_onnx(model, tmp_path / "m.onnx", (1, 3, 8, 8), external_data=True)
    assert result.external_data
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    assert (tmp_path / "m.onnx.data").stat().st_size > 16 * 36 * 10 * 4
    assert result.file_size == sum(f.stat().st_size for f in tmp_path.iterdir())


def test_simplify_with_onnxslim_is_verified(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    StructuredPrune(ratio=0.3, input_shape=SMALL)(model)
    result = export_onnx(model, tmp_path / "m.onnx", SMALL, simplify=True, opset=17)
    assert result.simplified and result.opset == 17
    assert all(v.passed for v in result.verification)
    assert onnx.load(str(tmp_path / "m.onnx")).opset_import[0].version == 17


def test_multiple_outputs_are_all_compared(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

        def forward(self, x):
            return self.a(x), {"b": self.b(x)}

    result = export_onnx(TwoHeads(), tmp_path / "m.onnx", (1, 4))
    assert len(onnx.load(str(tmp_path / "m.onnx")).graph.output) == 2
    assert all(v.passed for v in result.verification)


@pytest.mark.parametrize("kwargs, message", [
    ({"exporter": "tflite"}, "exporter must be one of"),
    ({"rtol": -1.0}, "rtol and atol must be >= 0"),
])
def test_bad_arguments_are_rejected(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        export_onnx(nn.Linear(2, 2), tmp_path / "m.onnx", (1, 2), **kwargs)


def test_bad_input_shape_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="input_shape must hold"):
        export_onnx(nn.Linear(2, 2), tmp_path / "m.onnx", (2,))


def test_exporter_failure_is_an_export_error(tmp_path):
    class ReturnsString(nn.Module):
        def forward(self, x):
            return "not a tensor"

    with pytest.raises(ExportError):
        export_onnx(ReturnsString(), tmp_path / "m.onnx", (1, 2), exporter="torchscript")
    assert os.listdir(tmp_path) == []


# CLI


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_export_writes_a_verified_file(tmp_path):
    out = tmp_path / "r18.onnx"
    result = _invoke("export", "torchvision:resnet18", "--num-classes", 10, "--input-shape", "1,3,64,64", "--onnx", out)
    assert result.exit_code == 0, result.output
    assert "Verified with ONNX Runtime: batch 1" in result.output and "batch 3" in result.output
    assert _run_onnx(out, torch.randn(2, 3, 64, 64)).shape == (2, 10)


def test_cli_exports_a_slimmed_checkpoint(tmp_path):
    from optkit.io.models import arch_spec

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10)
    StructuredPrune(ratio=0.3, input_shape=SMALL)(model)
    checkpoint.save(model, tmp_path / "model.pt", arch_spec("torchvision:mobilenet_v2", 10))
    result = _invoke("export", tmp_path / "model.pt", "--input-shape", "1,3,64,64", "--onnx", tmp_path / "m.onnx", "--fp16")
    assert result.exit_code == 0, result.output
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    np.testing.assert_allclose(_run_onnx(tmp_path / "m.onnx", x), expected, rtol=0, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("args, message", [
    (["torchvision:resnet18", "--input-shape", "1,3,64"], "does not run on input shape 1,3,64"),
    (["torchvision:no_such_model"], "no_such_model"),
    (["missing.pt"], "no such file"),
])
def test_cli_export_errors_are_one_line(tmp_path, args, message):
    result = _invoke("export", *args, "--onnx", tmp_path / "m.onnx")
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert message in result.output
    assert os.listdir(tmp_path) == []


def test_cli_export_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"keep")
    result = _invoke("export", "torchvision:resnet18", "--onnx", out)
    assert result.exit_code == 1 and "--force" in result.output
    assert out.read_bytes() == b"keep"


def test_optimize_export_onnx_writes_model_onnx_beside_model_pt(tmp_path):
    out = tmp_path / "run"
    result = _invoke("optimize", "torchvision:resnet18", "--num-classes", 10, "--input-shape", "1,3,64,64",
                     "--prune", 0.3, "--export", "onnx", "--no-latency", "--out", out)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == ["channels.png", "model.onnx", "model.pt", "recipe.toml", "report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    assert report["files"]["model.onnx"] == (out / "model.onnx").stat().st_size
    exported = report["export"]
    assert exported["path"] == "model.onnx" and all(v["passed"] for v in exported["verification"])
    assert exported["weights_after"]["weights"] < 0.7 * exported["weights_before"]["weights"]
    assert "model.onnx: torchscript exporter" in (out / "report.md").read_text()
    assert _run_onnx(out / "model.onnx", torch.randn(2, 3, 64, 64)).shape == (2, 10)


def test_optimize_unstructured_export_reports_compressed_sizes(tmp_path):
    out = tmp_path / "run"
    result = _invoke("optimize", "torchvision:squeezenet1_1", "--num-classes", 10, "--input-shape", "1,3,64,64",
                     "--prune", 0.5, "--method", "unstructured", "--export", "onnx", "--no-latency", "--out", out)
    assert result.exit_code == 0, result.output
    exported = json.loads((out / "report.json").read_text())["export"]
    assert exported["weights_after"]["weights"] == exported["weights_before"]["weights"]
    assert exported["weights_after"]["weights_gzip"] < 0.8 * exported["weights_before"]["weights_gzip"]
    assert "run no faster on zeros" in (out / "report.md").read_text()


def test_optimize_with_failing_export_writes_nothing(tmp_path, monkeypatch):
    def mismatch(*args, **kwargs):
        raise ExportError("ONNX Runtime outputs differ from PyTorch at batch size 1: simulated")

    monkeypatch.setattr(export, "verify_onnx", mismatch)
    monkeypatch.setattr(export, "AUTO_ORDER", ("torchscript",))
    out = tmp_path / "run"
    result = _invoke("optimize", "torchvision:resnet18", "--num-classes", 10, "--input-shape", "1,3,64,64",
                     "--prune", 0.3, "--export", "onnx", "--out", out)
    assert result.exit_code == 1
    assert result.output.splitlines()[-1].startswith("Error: ONNX export of ResNet failed, nothing was written")
    assert not out.exists()


def test_optimize_rejects_an_unknown_export_format(tmp_path):
    result = _invoke("optimize", "torchvision:resnet18", "--prune", 0.3, "--export", "tflite", "--out", tmp_path)
    assert result.exit_code == 2 and "tflite" in result.output


def test_a_large_files_gzipped_size_is_estimated_from_a_sample_within_a_few_percent(tmp_path, monkeypatch):
    """An exact gzip of Llama-3.2-1B's 4 GB ONNX file ran for over ten silent minutes after its verification."""
    import zlib

    import numpy as np

    from optkit.export import onnx as onnx_export

    rng = np.random.default_rng(0)
    # Half low-entropy noise, half zeros (as pruned weights): a sample must see both halves.
    data = np.concatenate([rng.integers(0, 4, 12 << 20, dtype=np.uint8), np.zeros(12 << 20, np.uint8)]).tobytes()
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    exact = len(compressor.compress(data)) + len(compressor.flush())
    assert onnx_export.gzip_size(path) == exact  # below the limit: exact
    # About 64 pieces sampled, as at the real limit and piece size for any file above it.
    monkeypatch.setattr(onnx_export, "GZIP_EXACT_MAX_BYTES", 4 << 20)
    monkeypatch.setattr(onnx_export, "_GZIP_PIECE", 64 << 10)
    assert onnx_export.gzip_is_estimated(len(data))
    estimated = onnx_export.gzip_size(path)
    assert estimated != exact and abs(estimated - exact) <= 0.05 * exact
