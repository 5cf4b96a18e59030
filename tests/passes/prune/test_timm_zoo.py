"""Structured pruning on timm architectures: every model comes back running, held layers say why.

Each model runs at its default input size with random weights. The fast ones
run by default; the rest of the development set (benchmarks/zoo.py --zoo timm)
is behind ``-m slow``.
"""

from __future__ import annotations

import pytest
import torch

from optkit.model.stats import count_macs
from optkit.passes.prune.passes import StructuredPrune

timm = pytest.importorskip("timm")

FAST = ["pit_ti_224", "efficientvit_b0"]
SLOW = [
    "xcit_nano_12_p16_224", "crossvit_tiny_240", "convit_tiny", "visformer_tiny", "tnt_s_patch16_224", "nest_tiny",
    "volo_d1_224", "efficientvit_m0", "repvit_m0_9", "tiny_vit_5m_224", "maxvit_nano_rw_256", "coatnet_nano_rw_224",
    "davit_tiny", "focalnet_tiny_srf", "twins_svt_small", "swin_tiny_patch4_window7_224", "hiera_tiny_224",
    "eva02_tiny_patch14_224", "caformer_s18", "shvit_s1", "swiftformer_xs", "fasternet_t0", "starnet_s1",
    "mambaout_femto", "hgnetv2_b0", "ghostnetv2_100", "repghostnet_100", "spnasnet_100", "hardcorenas_a",
    "semnasnet_075", "fbnetv3_b", "xception41p", "tresnet_m", "sequencer2d_s", "gmlp_ti16_224", "mixer_s16_224",
    "resmlp_12_224",
    "halonet26t", "lambda_resnet26t", "cs3darknet_s", "darknet17", "gcresnet33ts", "vovnet39a", "legacy_seresnet18",
    "inception_next_atto",
]


@pytest.mark.parametrize("name", FAST + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_timm_model_prunes_and_runs(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    shape = (1, *model.pretrained_cfg["input_size"])
    macs_before = count_macs(model, shape)
    details = StructuredPrune(ratio=0.3, input_shape=shape).apply(model).details
    macs_ratio = count_macs(model, shape) / macs_before
    model.train()
    out = model(torch.randn(2, *shape[1:]))
    assert out.shape == (2, model.num_classes)
    out.float().mean().backward()
    held = details.get("held_layers", {})
    assert all(isinstance(reason, str) and reason for reason in held.values())
    if macs_ratio > 0.75:
        assert held and details["shortfall"].startswith(("asked 0.3", "nothing pruned"))
    if held:
        assert f"{len(held)} layer" in details["shortfall"] or "nothing pruned" in details["shortfall"]


# Small configs of development-set models whose attention or patch merging used to be held at full width.
TINY = {
    "xcit_nano_12_p16_224": (dict(depth=2, img_size=64), 64),  # XCA / class attention: heads of C // num_heads
    "twins_svt_small": (dict(depths=(1, 1, 1, 1), img_size=64), 64),  # and a strided conv + norm on keys, values
    "swin_tiny_patch4_window7_224": (dict(depths=(1, 1, 1, 1), img_size=112), 112),  # channels-last patch merging
}


@pytest.mark.parametrize("name", list(TINY))
def test_small_timm_attention_is_pruned_not_held(name):
    torch.manual_seed(0)
    kwargs, size = TINY[name]
    model = timm.create_model(name, pretrained=False, **kwargs)
    shape = (1, 3, size, size)
    macs_before = count_macs(model, shape)
    details = StructuredPrune(ratio=0.3, input_shape=shape).apply(model).details
    assert details.get("held_layers", {}) == {}
    assert count_macs(model, shape) / macs_before <= 0.6
    out = model.train()(torch.randn(2, *shape[1:]))
    assert out.shape == (2, model.num_classes)
    out.float().mean().backward()
