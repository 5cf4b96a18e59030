"""Tests for optkit.passes.prune.passes: structured and unstructured pruning on real architectures."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from optkit.io import checkpoint

from optkit.core import recipe
from optkit.core.errors import OptkitError
from optkit.io.models import ArchSpec, load_model, torchvision_names
from optkit.model.stats import count_macs, count_params, weight_sparsity
from optkit.passes.prune.graph import limits as _prune_limits
from optkit.passes.prune.passes import L1Unstructured, StructuredPrune, skipped_layers

SMALL = (1, 3, 64, 64)

# One model per family, at the smallest input each accepts. The transformer
# families are built as smaller configurations of the same torchvision classes
# (the full named models run in the slow tests and in benchmarks/zoo.py).
FAMILIES = {
    "resnet18": SMALL,
    "resnext50_32x4d": SMALL,
    "wide_resnet50_2": SMALL,
    "vgg11_bn": SMALL,
    "alexnet": SMALL,
    "squeezenet1_0": SMALL,
    "densenet121": SMALL,
    "googlenet": SMALL,
    "inception_v3": (1, 3, 96, 96),
    "mobilenet_v2": SMALL,
    "mobilenet_v3_small": SMALL,
    "mnasnet0_5": SMALL,
    "shufflenet_v2_x0_5": SMALL,
    "efficientnet_b0": SMALL,
    "efficientnet_v2_s": SMALL,
    "regnet_x_400mf": SMALL,
    "regnet_y_400mf": SMALL,
    "convnext_tiny": SMALL,
    "small_vit": SMALL,
    "small_swin": SMALL,
    "small_swin_v2": SMALL,
    "small_maxvit": SMALL,
}

SMALL_ARCHS = {
    "small_vit": ("torchvision.models.vision_transformer:VisionTransformer",
                  {"image_size": 64, "patch_size": 16, "num_layers": 2, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 256}),
    "small_swin": ("torchvision.models.swin_transformer:SwinTransformer",
                   {"patch_size": [4, 4], "embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4],
                    "window_size": [4, 4], "stochastic_depth_prob": 0.0}),
    "small_maxvit": ("torchvision.models.maxvit:MaxVit",
                     {"input_size": [64, 64], "stem_channels": 32, "partition_size": 2, "block_channels": [32, 64],
                      "block_layers": [1, 2], "head_dim": 16, "stochastic_depth_prob": 0.0}),
}


def arch(name: str) -> ArchSpec:
    spec, kwargs = SMALL_ARCHS.get(name, (f"torchvision:{name}", {}))
    return ArchSpec(spec, kwargs)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "small_swin_v2":
        from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

        return SwinTransformer(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2,
                               **SMALL_ARCHS["small_swin"][1])
    return arch(name).build()


def check_pruned(model: nn.Module, shape, max_macs_ratio: float = 0.75) -> dict:
    macs_before, params_before = count_macs(model, shape), count_params(model)
    result = StructuredPrune(ratio=0.3, input_shape=shape).apply(model)
    macs_ratio = count_macs(model, shape) / macs_before
    assert macs_ratio <= max_macs_ratio
    assert count_params(model) < params_before
    model.train()
    x = torch.randn(2, *shape[1:])
    out = model(x)
    assert out.shape == (2, 1000)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return result.details


@pytest.mark.parametrize("name", list(FAMILIES))
def test_structured_prune_every_family(name):
    details = check_pruned(build(name), FAMILIES[name])
    assert details["pruned_layers"] > 0
    assert all(isinstance(reason, str) and reason for reason in details["skipped_layers"].values())


@pytest.mark.slow
@pytest.mark.parametrize("name", torchvision_names())
def test_structured_prune_whole_zoo(name):
    shape = (1, 3, 299, 299) if name == "inception_v3" else (1, 3, 224, 224)
    check_pruned(load_model(f"torchvision:{name}"), shape)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "small_vit", "small_swin"])
def test_l1_unstructured_reports_exact_sparsity(name):
    model = build(name)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(module.weight)  # some classes start with zero weights (ViT's head)
    details = L1Unstructured(ratio=0.4).apply(model).details
    assert details["sparsity"] == weight_sparsity(model)
    assert details["sparsity"] == pytest.approx(0.4, abs=1e-3)
    assert not any(hasattr(m, "weight_orig") for m in model.modules())


@pytest.mark.slow
@pytest.mark.parametrize("name", torchvision_names())
def test_l1_unstructured_whole_zoo(name):
    model = load_model(f"torchvision:{name}")
    zeros_before = weight_sparsity(model)
    details = L1Unstructured(ratio=0.3).apply(model).details
    assert details["sparsity"] == weight_sparsity(model)
    assert 0.3 - 1e-3 <= details["sparsity"] <= 0.3 + zeros_before + 1e-3


def test_shufflenet_reports_shuffle_blocks_it_keeps():
    model = build("shufflenet_v2_x0_5")
    skipped = StructuredPrune(input_shape=SMALL).apply(model).details["skipped_layers"]
    assert "stage3.0.branch1.2" in skipped and "channel shuffle" in skipped["stage3.0.branch1.2"]
    assert model.stage2[1].branch2[0].out_channels < 24  # inner branch channels were pruned


def test_vit_heads_and_hidden_dim_written_back():
    model = build("small_vit")
    StructuredPrune(input_shape=SMALL).apply(model)
    attention = model.encoder.layers[0].self_attention
    assert model.hidden_dim == model.conv_proj.out_channels < 64
    assert attention.embed_dim == model.hidden_dim and attention.embed_dim % attention.num_heads == 0


def test_swin_attention_keeps_heads_consistent():
    model = build("small_swin")
    StructuredPrune(input_shape=SMALL).apply(model)
    block = model.features[1][0]
    width = block.norm1.normalized_shape[0]
    assert width < 32 and width % block.attn.num_heads == 0
    assert block.attn.qkv.weight.shape == (3 * width, width)
    assert model.features[2].reduction.in_features == 4 * width


def test_detection_model_prunes_its_backbone():
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=3).eval()
    before = count_params(model.backbone)
    details = StructuredPrune(input_shape=(1, 3, 128, 128)).apply(model).details
    assert details["submodule"] == "backbone"
    assert count_params(model.backbone) < 0.8 * before
    with torch.no_grad():
        detections = model([torch.rand(3, 128, 128)])
    assert set(detections[0]) == {"boxes", "labels", "scores"}


def test_segmentation_model_prunes_its_backbone():
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    torch.manual_seed(0)
    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3).eval()
    before = count_params(model.backbone)
    StructuredPrune(input_shape=SMALL).apply(model)
    assert count_params(model.backbone) < 0.8 * before
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64))["out"].shape == (1, 3, 64, 64)


@pytest.mark.parametrize("importance", ["l1", "l2", "bn_scale", "random", "taylor"])
def test_importance_choices_prune(importance):
    model = build("resnet18")
    batches = [(torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))) for _ in range(2)]
    extra = {"calibration": batches} if importance == "taylor" else {}
    StructuredPrune(ratio=0.3, importance=importance, input_shape=SMALL, round_to=8, **extra).apply(model)
    assert model.layer1[0].conv1.out_channels == 40  # 64 * 0.7 = 44.8, rounded down to a multiple of 8


def test_taylor_ranks_by_gradients_not_weights():
    kept = {}
    for importance in ("l1", "taylor"):
        model = build("resnet18")
        batches = [(torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))) for _ in range(2)]
        extra = {"calibration": batches} if importance == "taylor" else {}
        with torch.no_grad():
            model.layer1[0].conv1.weight[:8] *= 100  # L1 keeps these; Taylor looks at gradients too
        StructuredPrune(ratio=0.5, importance=importance, input_shape=SMALL, round_to=1, **extra).apply(model)
        kept[importance] = model.layer1[0].conv1.weight.detach().clone()
    assert kept["l1"].shape == kept["taylor"].shape
    assert not torch.equal(kept["l1"], kept["taylor"])


def test_taylor_needs_data():
    with pytest.raises(ValueError, match="taylor.*data"):
        StructuredPrune(importance="taylor")


def test_round_to_and_per_layer_widths():
    model = build("resnet18")
    StructuredPrune(ratio=0.3, round_to=1, input_shape=SMALL).apply(model)
    assert model.layer1[0].conv1.out_channels == 44
    model = build("resnet18")
    StructuredPrune(ratio=0.3, round_to=8, input_shape=SMALL).apply(model)
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(w % 8 == 0 for w in widths)


def test_attention_heads_are_rounded_per_head():
    # 4 heads of 16: 30% off each head keeps 11, rounded to 10 so that the
    # width (4 x 10) is a multiple of round_to=8. Rounding each head's count
    # as if it were the whole layer's would cut every head to 8 (half).
    model = build("small_vit")
    StructuredPrune(ratio=0.3, round_to=8, input_shape=SMALL).apply(model)
    assert model.hidden_dim == 40
    assert model.encoder.layers[0].self_attention.num_heads == 4


def test_grouped_conv_is_rounded_per_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, groups=8),
                          nn.ReLU(), nn.Conv2d(32, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    StructuredPrune(ratio=0.3, round_to=8, input_shape=(1, 3, 16, 16)).apply(model)
    grouped = model[2]
    assert grouped.groups == 8 and grouped.out_channels % 8 == 0 and 8 <= grouped.out_channels < 32
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_global_ranking_gives_uneven_widths():
    def inner_widths(model):  # the first conv of each residual block: its output is pruned on its own
        return [block.conv1.out_channels for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                for block in layer]

    original = inner_widths(build("resnet18"))
    widths = {}
    for allocation in ("uniform", "global"):
        model = build("resnet18")
        StructuredPrune(ratio=0.3, allocation=allocation, round_to=1, input_shape=SMALL).apply(model)
        widths[allocation] = [w / w0 for w, w0 in zip(inner_widths(model), original)]
    assert max(widths["uniform"]) - min(widths["uniform"]) < 0.05  # per layer: the same fraction everywhere
    assert max(widths["global"]) - min(widths["global"]) > 0.1  # global: some layers keep more than others


def test_iterative_steps_reach_the_same_ratio():
    one, three = build("resnet18"), build("resnet18")
    StructuredPrune(ratio=0.4, round_to=1, input_shape=SMALL).apply(one)
    StructuredPrune(ratio=0.4, round_to=1, iterative_steps=3, input_shape=SMALL).apply(three)
    assert count_params(three) == pytest.approx(count_params(one), rel=0.02)


def test_layer_ratio_overrides_and_ignored_layers():
    model = build("resnet18")
    details = StructuredPrune(ratio=0.3, round_to=8, input_shape=SMALL, layer_ratios={"layer4.*": 0.6},
                              ignored_layers=("layer2.*",)).apply(model).details
    assert model.layer1[0].conv1.out_channels == 40
    assert model.layer4[0].conv1.out_channels == 200  # 512 * 0.4 = 204.8 -> 200
    assert model.layer2[0].conv1.out_channels == model.layer2[0].conv2.out_channels == 128
    # Ignored layers keep their outputs; their inputs follow what feeds them.
    assert model.layer2[0].conv1.in_channels < 64
    assert "ignored_layers pattern 'layer2.*'" in details["skipped_layers"]["layer2.0.conv2"]
    assert "fc" not in details["skipped_layers"]  # its inputs shrink with layer4
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_unmatched_pattern_is_an_error():
    with pytest.raises(ValueError, match="'layer9'"):
        StructuredPrune(input_shape=SMALL, ignored_layers=("layer9",)).apply(build("resnet18"))


@pytest.mark.parametrize("settings, message", [
    ({"ratio": 1.0}, "ratio"),
    ({"importance": "l3"}, "importance"),
    ({"allocation": "even"}, "allocation"),
    ({"round_to": 0}, "round_to"),
    ({"iterative_steps": 0}, "iterative_steps"),
    ({"target_macs": 0.0}, "target_macs"),
    ({"target_macs": 0.5, "target_params": 0.5}, "not both"),
    ({"layer_ratios": {"layer1": 1.5}}, "layer_ratios"),
    ({"ignored_layers": "layer1"}, "ignored_layers"),
])
def test_invalid_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        StructuredPrune(**settings)


def test_settings_round_trip_through_a_recipe():
    original = StructuredPrune(ratio=0.25, round_to=4, importance="taylor", allocation="global", iterative_steps=2,
                               ignored_layers=("layer1.*",), layer_ratios={"layer4.*": 0.5}, target_macs=0.5,
                               timeout_s=30.0, data="fashion-mnist", calibration_batches=2, batch_size=8,
                               calibration=[(torch.zeros(1), torch.zeros(1))])
    text = recipe.dumps([original, L1Unstructured(ratio=0.2, global_=True)])
    loaded = recipe.parse(text)["passes"]
    assert loaded[0].settings() == original.settings()
    assert "calibration =" not in text and "calibration_batches = 2" in text
    assert loaded[1] == L1Unstructured(ratio=0.2, global_=True)


def test_target_macs_lands_near_the_target():
    model = build("resnet18")
    result = StructuredPrune(target_macs=0.5, target_tolerance=0.02, input_shape=SMALL).apply(model)
    achieved = count_macs(result.model, SMALL) / count_macs(model, SMALL)
    assert result.details["achieved_fraction"] == pytest.approx(achieved, abs=1e-4)
    assert abs(achieved - 0.5) <= 0.03
    assert result.model is not model and count_params(model) == count_params(build("resnet18"))


def test_target_params():
    model = build("mobilenet_v2")
    result = StructuredPrune(target_params=0.6, target_tolerance=0.02, input_shape=SMALL).apply(model)
    assert abs(count_params(result.model) / count_params(model) - 0.6) <= 0.03


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "vit_b_16"])
def test_target_macs_acceptance_models(name):
    shape = (1, 3, 224, 224)
    model = load_model(f"torchvision:{name}")
    result = StructuredPrune(target_macs=0.5, input_shape=shape).apply(model)
    assert abs(count_macs(result.model, shape) / count_macs(model, shape) - 0.5) <= 0.03


def test_skipped_layers_dry_run():
    model = build("resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skipped = skipped_layers(model, SMALL, ignored_layers=("layer3.*",))
    assert "layer3.0.conv2" in skipped and "layer3.1.conv1" in skipped
    assert "fc" not in skipped and "layer4.0.conv1" not in skipped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training
    shuffle = skipped_layers(build("shufflenet_v2_x0_5"), SMALL)
    assert "stage4.0.branch1.0" in shuffle


def test_time_limit_leaves_the_model_unchanged_with_a_clear_shortfall():
    model = build("densenet121")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    details = StructuredPrune(input_shape=SMALL, timeout_s=1e-4, fallback_trials=2).apply(model).details
    assert "did not finish within" in details["shortfall"] and "unchanged" in details["shortfall"]
    assert details["pruned_layers"] == 0
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_time_limit_interrupts_a_python_loop():
    with pytest.raises(_prune_limits.TimeLimitExceeded):
        with _prune_limits.time_limit(0.05):
            while True:
                pass


def test_time_limit_outside_the_main_thread_is_reported():
    results = {}
    thread = threading.Thread(target=lambda: results.update(
        StructuredPrune(input_shape=SMALL, timeout_s=60).apply(build("resnet18")).details))
    thread.start()
    thread.join()
    assert "not enforced" in results["time_limit"]


@pytest.mark.parametrize("name", ["resnet18", "small_vit", "small_swin", "small_maxvit", "shufflenet_v2_x0_5"])
def test_pruned_model_round_trips_through_a_checkpoint(name, tmp_path):
    model = build(name)
    StructuredPrune(input_shape=SMALL).apply(model)
    checkpoint.save(model, tmp_path / "model.pt", arch(name))
    reloaded = load_model(tmp_path / "model.pt")
    x = torch.randn(1, *SMALL[1:])
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), model(x), rtol=1e-4, atol=1e-4)


def test_cli_flags_build_structured_prune_entries():
    import click

    from optkit.cli.optimize import pass_entries_from_flags

    entry = pass_entries_from_flags({"target_macs": 0.5, "iterative_steps": 3, "importance": "taylor",
                                     "calib_data": "fashion-mnist"})[0]
    assert entry == {"name": "structured_prune", "importance": "taylor", "target_macs": 0.5, "iterative_steps": 3,
                     "data": "fashion-mnist"}
    assert recipe.from_dict({"pass": [entry]})["passes"][0].target_macs == 0.5
    with pytest.raises(click.UsageError, match="calib-data"):
        pass_entries_from_flags({"prune": 0.3, "importance": "taylor"})
    with pytest.raises(click.UsageError, match="not both"):
        pass_entries_from_flags({"target_macs": 0.5, "target_params": 0.5})
    with pytest.raises(click.UsageError, match="--target-params replaces --prune: give one of them"):
        pass_entries_from_flags({"prune": 0.3, "target_params": 0.5})


def test_a_target_that_removes_nothing_is_an_error_naming_the_target():
    import copy

    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(4))
    model(torch.randn(1, 3, 12, 12))
    before = copy.deepcopy(model.state_dict())
    prune = StructuredPrune(target_params=0.8, ignored_layers=("*",), input_shape=(1, 3, 12, 12))
    with pytest.raises(OptkitError, match=r"removed nothing: asked params 0.8 of the original, achieved 1.000"):
        prune(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_missed_target_is_the_first_note():
    from optkit.passes.prune.passes import _lead_with_a_miss

    details = {"target": "params", "target_fraction": 0.8, "achieved_fraction": 0.85,
               "notes": ["structured_prune refitted 4 layer(s)", "something else"]}
    _lead_with_a_miss(details)
    assert details["notes"][0] == "structured_prune: asked params 0.8 of the original, achieved 0.850"
    assert details["notes"][1:] == ["structured_prune refitted 4 layer(s)", "something else"]
    within = {"target": "params", "target_fraction": 0.8, "achieved_fraction": 0.81, "notes": ["a", "b"]}
    _lead_with_a_miss(within)
    assert within["notes"] == ["a", "b"]
