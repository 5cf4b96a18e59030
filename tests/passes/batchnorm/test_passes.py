"""Tests for optkit/passes/batchnorm.py: insert, fold and recalibrate BatchNorm."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optkit.io import checkpoint

from optkit.io import models
from optkit.model.batchnorm import fold_batchnorm
from optkit.model.dataflow import data_flow
from optkit.passes import get_pass
from optkit.passes.batchnorm.modules import ConvBatchNorm
from optkit.passes.batchnorm.passes import (
    FoldBatchNorm,
    InsertBatchNorm,
    RecalibrateBatchNorm,
    insert_batchnorm,
    recalibrate_batchnorm,
)
from optkit.core.pipeline import Pipeline
from tests.support.batchnorm_nets import BNS, CONVS, DataDependent, build, eval_out, randomize_bn, rel

SHAPE = (1, 3, 64, 64)


def _bn_after_every_conv(model: nn.Module) -> list[str]:
    """Convs whose output does not go straight into a BatchNorm (by data flow)."""
    flow = data_flow(model, torch.randn(SHAPE))
    modules = dict(model.named_modules())
    return [name for name, m in modules.items() if isinstance(m, CONVS)
            if not any(isinstance(modules.get(u), BNS) for u in flow.users[name])]


# --- insert -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["vgg11", "alexnet", "squeezenet1_0", "branch_concat"])
def test_insert_preserves_eval_output_and_covers_every_conv(name):
    model = build(name)
    x = torch.randn(2, *SHAPE[1:])
    before = eval_out(model, x)
    convs = sum(isinstance(m, CONVS) for m in model.modules())

    details = insert_batchnorm(model, input_shape=SHAPE)

    assert len(details["inserted"]) == convs
    assert rel(eval_out(model, x), before) <= 1e-5
    assert _bn_after_every_conv(model) == []


def test_insert_is_a_no_op_on_resnet():
    model = build("resnet18")
    types_before = [type(m) for m in model.modules()]
    details = insert_batchnorm(model, input_shape=SHAPE)
    assert details["inserted"] == []
    assert len(details["already_normalized"]) == 20
    assert [type(m) for m in model.modules()] == types_before


def test_insert_twice_inserts_nothing_the_second_time():
    model = build("branch_concat")
    insert_batchnorm(model)
    assert insert_batchnorm(model)["inserted"] == []


def test_insert_skips_conv_already_followed_by_relu_then_norm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 3))
    details = insert_batchnorm(model, input_shape=(1, 3, 16, 16))
    assert details["already_normalized"] == ["0"]
    assert details["inserted"] == ["3"]


def test_insert_matches_conv_dimensionality():
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Unflatten(1, (1, 1, 1, 4 * 14)),
                          nn.Conv3d(1, 3, 1))
    insert_batchnorm(model, input_shape=(1, 2, 16))
    assert isinstance(model[0][1], nn.BatchNorm1d) and model[0][1].num_features == 4
    assert isinstance(model[4][1], nn.BatchNorm3d) and model[4][1].num_features == 3


def test_insert_with_calibration_sets_statistics_from_activations():
    model = build("branch_concat")
    reference = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(16, 3, 32, 32, generator=g), torch.zeros(16)) for _ in range(3)]
    seen = []
    hook = reference.merge.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        for x, _ in batches:
            reference(x)
    hook.remove()
    activations = torch.cat(seen).transpose(0, 1).reshape(16, -1)

    details = insert_batchnorm(model, batches)

    assert details["calibration_batches"] == 3
    bn = model.merge[1]
    torch.testing.assert_close(bn.running_mean, activations.mean(dim=1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_var, activations.var(dim=1), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(bn.weight.detach(), (bn.running_var + bn.eps).sqrt())
    x = torch.rand(16, 3, 32, 32, generator=g)
    assert rel(eval_out(model, x), eval_out(reference, x)) <= 1e-5
    model.train()
    with torch.no_grad():
        train_out = model(x)
    assert rel(train_out, eval_out(reference, x)) <= 0.1


def test_insert_rejects_empty_calibration():
    with pytest.raises(ValueError, match="at least one batch"):
        insert_batchnorm(build("branch_concat"), [])


def test_insert_uses_autograd_graph_when_fx_cannot_trace():
    model = DataDependent()
    x = torch.randn(2, 3, 16, 16)
    before = eval_out(model, x)
    details = insert_batchnorm(model, input_shape=(1, 3, 16, 16))
    assert details["dataflow"] == "autograd" and "fx_error" in details
    assert details["inserted"] == ["conv3"]
    assert sorted(details["already_normalized"]) == ["conv1", "conv2"]
    assert rel(eval_out(model, x), before) <= 1e-5


def test_insert_then_fold_removes_the_wrapper_batchnorm():
    model = build("vgg11")
    x = torch.randn(2, *SHAPE[1:])
    before = eval_out(model, x)
    insert_batchnorm(model, [torch.randn(4, *SHAPE[1:]) for _ in range(2)])
    details = fold_batchnorm(model, input_shape=SHAPE)
    assert len(details["folded"]) == 8
    assert not any(isinstance(m, BNS) for m in model.modules())
    assert rel(eval_out(model, x), before) <= 1e-4


# --- recalibrate ------------------------------------------------------------------------------

def _small_bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.5),
                         nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4))


def test_recalibrate_computes_cumulative_statistics_without_touching_weights():
    model = _small_bn_net()
    randomize_bn(model)
    model[1].momentum = 0.3
    model.train()
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    g = torch.Generator().manual_seed(2)
    batches = [torch.rand(8, 3, 10, 10, generator=g) * 3 for _ in range(5)]

    details = recalibrate_batchnorm(model, ((x, None) for x in batches), num_batches=4)

    assert details == {"recalibrated": 2, "batches": 4, "not_reached": []}
    conv_out = torch.cat([model[0](x) for x in batches[:4]]).detach()
    per_batch_var = torch.stack([model[0](x).detach().transpose(0, 1).reshape(6, -1).var(dim=1) for x in batches[:4]])
    torch.testing.assert_close(model[1].running_mean, conv_out.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_var, per_batch_var.mean(dim=0), rtol=1e-4, atol=1e-5)
    assert int(model[1].num_batches_tracked) == 4
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert model.training and all(m.training for m in model.modules())
    assert model[1].momentum == 0.3 and model[5].momentum == 0.1


class OneOfTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.BatchNorm2d(3)
        self.unused = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.used(x)


def test_recalibrate_keeps_statistics_of_unreached_batchnorm():
    model = OneOfTwo()
    randomize_bn(model)
    unused_mean = model.unused.running_mean.clone()
    details = recalibrate_batchnorm(model, [torch.randn(4, 3, 5, 5)])
    assert details["not_reached"] == ["unused"]
    assert torch.equal(model.unused.running_mean, unused_mean)
    assert not torch.equal(model.used.running_mean, unused_mean)


def test_recalibrate_rejects_no_batches_and_restores_state():
    model = _small_bn_net()
    randomize_bn(model)
    mean = model[1].running_mean.clone()
    with pytest.raises(ValueError, match="no batches"):
        recalibrate_batchnorm(model, [])
    assert torch.equal(model[1].running_mean, mean)
    with pytest.raises(ValueError, match="must be a tensor"):
        recalibrate_batchnorm(model, [torch.randn(4, 3, 8, 8), "not a batch"])
    assert torch.equal(model[1].running_mean, mean) and model[1].momentum == 0.1


# --- passes, recipes, checkpoints, CLI --------------------------------------------------------

def test_passes_are_registered_and_validate_settings():
    assert get_pass("insert_batchnorm") is InsertBatchNorm
    assert get_pass("fold_batchnorm") is FoldBatchNorm
    assert get_pass("recalibrate_batchnorm") is RecalibrateBatchNorm
    with pytest.raises(ValueError, match="recalibrating BatchNorm needs data"):
        RecalibrateBatchNorm()
    with pytest.raises(ValueError, match="batches must be an integer >= 1"):
        RecalibrateBatchNorm(data="fashion-mnist", batches=0)
    with pytest.raises(ValueError, match="split must be one of"):
        InsertBatchNorm(split="dev")
    with pytest.raises(ValueError, match="eps must be"):
        InsertBatchNorm(eps=0)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0 or 'auto'"):
        RecalibrateBatchNorm(data="fashion-mnist", num_workers=-1)


def test_pipeline_with_data_specs_and_recipe_round_trip():
    pipeline = Pipeline([InsertBatchNorm(data="synthetic:64:3x16x16", batches=2, batch_size=8, num_workers="auto"),
                         RecalibrateBatchNorm(data="synthetic:64:3x16x16", batches=3, batch_size=8),
                         FoldBatchNorm()], input_shape=(1, 3, 16, 16))
    assert Pipeline.from_toml(pipeline.to_toml()).to_toml() == pipeline.to_toml()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    x = torch.randn(2, 3, 16, 16)
    before = eval_out(model, x)
    run = pipeline.run(model, measure_stats=False)
    inserted, recalibrated, folded = (r.details for r in run.records)
    assert inserted["inserted"] == ["0", "2"] and inserted["calibration_batches"] == 2
    assert recalibrated["batches"] == 3 and recalibrated["recalibrated"] == 2
    assert len(folded["folded"]) == 2
    # Recalibration re-estimated the statistics the BN weights were set to undo, so outputs move a little.
    assert rel(eval_out(run.model, x), before) <= 0.2


@pytest.mark.slow  # 20 s of VGG-11 weights saved and loaded twice
def test_inserted_and_folded_models_round_trip_through_checkpoint(tmp_path):
    arch = models.arch_spec("torchvision:vgg11", 10)
    model = arch.build()
    insert_batchnorm(model, [torch.randn(4, *SHAPE[1:]) for _ in range(2)])
    x = torch.randn(2, *SHAPE[1:])
    checkpoint.save(model, tmp_path / "inserted.pt", arch)
    loaded = models.load_model(tmp_path / "inserted.pt")
    assert isinstance(loaded.features[0], ConvBatchNorm) and isinstance(loaded.features[0][1], nn.BatchNorm2d)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    torch.testing.assert_close(eval_out(loaded, x), eval_out(model, x), rtol=0, atol=0)

    fold_batchnorm(loaded, input_shape=SHAPE)
    checkpoint.save(loaded, tmp_path / "folded.pt", arch)
    reloaded = models.load_model(tmp_path / "folded.pt")
    assert isinstance(reloaded.features[0][1], nn.Identity)
    assert rel(eval_out(reloaded, x), eval_out(model, x)) <= 1e-4


def test_optimize_flags_build_batchnorm_entries():
    import click

    from optkit.cli.optimize import pass_entries_from_flags

    base = {"prune": 0.5}
    entries = pass_entries_from_flags({**base, "insert_bn": True, "fold_bn": True, "recalibrate_bn": 5,
                                       "calib_data": "fashion-mnist"})
    assert [e["name"] for e in entries] == ["insert_batchnorm", "structured_prune", "recalibrate_batchnorm",
                                            "fold_batchnorm"]
    assert entries[0]["data"] == "fashion-mnist" and entries[2] == {
        "name": "recalibrate_batchnorm", "data": "fashion-mnist", "batches": 5}
    with_workers = pass_entries_from_flags({**base, "recalibrate_bn": 5, "calib_data": "fashion-mnist", "workers": 2})
    assert [e.get("num_workers") for e in with_workers] == [None, 2]
    with pytest.raises(click.UsageError, match="--calib-data"):
        pass_entries_from_flags({**base, "recalibrate_bn": 5, "calib_data": None})
    with pytest.raises(click.UsageError, match=r"--calib-data is a setting of insert_batchnorm \(--insert-bn\).*"
                                               r"recalibrate_batchnorm \(--recalibrate-bn\)"):
        pass_entries_from_flags({"fold_bn": True, "calib_data": "fashion-mnist"})


def test_optimize_cli_folds_batchnorm(tmp_path):
    from click.testing import CliRunner

    from optkit.cli import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--fold-bn", "--input-shape", "1,3,32,32",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert 'name = "fold_batchnorm"' in (out / "recipe.toml").read_text()
    reloaded = models.load_model(out / "model.pt")
    assert not any(isinstance(m, BNS) for m in reloaded.modules())


def _rgb_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 10))


def test_recalibrate_repeats_grayscale_images_to_the_models_channels_as_training_does():
    """#31: grayscale data for an RGB model was fed as-is and failed; training repeats it to 3 channels."""
    model = _rgb_net()
    run = Pipeline([RecalibrateBatchNorm(data="synthetic:64:1x12x12:10", batches=2, batch_size=8)],
                   input_shape=(1, 3, 16, 16)).run(model, measure_stats=False)
    assert run.records[0].details["batches"] == 2 and run.records[0].details["recalibrated"] == 1
    assert int(model[1].num_batches_tracked) == 2


def test_insert_calibrates_on_grayscale_images_adapted_to_the_input_shape():
    model = InsertBatchNorm(data="synthetic:64:1x12x12:10", batches=2, batch_size=8,
                            input_shape=(1, 3, 16, 16))(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    assert isinstance(model[0], ConvBatchNorm)
    # Calibrated from the data's activations, not left at the identity's running_var of 1 - eps.
    assert int(model[0][1].num_batches_tracked) == 2
