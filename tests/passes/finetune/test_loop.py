"""Tests for optkit.passes.finetune.loop: fit learns, keeps sparsity, decays only weights, honours the caps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optkit.core.errors import TrainingError
from optkit.passes.device.passes import resolve_device
from optkit.passes.finetune.loop import evaluate, fit
from optkit.passes.finetune.sampling import capped
from optkit.passes.precision.autocast import training_dtype
from tinytrain import CountingData, tiny_data, tiny_model, tiny_settings


def test_fit_learns_and_keeps_best_epoch():
    data = tiny_data()
    model = tiny_model()
    before = evaluate(model, data)["accuracy"]
    result = fit(model, data, data, tiny_settings(epochs=4), progress=False)
    assert len(result.history) == 4
    best = max(h["val_accuracy"] for h in result.history)
    assert result.best_accuracy == pytest.approx(best)
    assert result.history[result.best_epoch - 1]["val_accuracy"] == pytest.approx(best)
    assert evaluate(model, data)["accuracy"] == pytest.approx(best)
    assert best > before + 0.2


def test_fit_keeps_pruned_weights_at_zero():
    model = tiny_model()
    with torch.no_grad():
        model[0].weight[:2] = 0
    fit(model, tiny_data(), None, tiny_settings(epochs=1), progress=False)
    assert torch.count_nonzero(model[0].weight[:2]) == 0
    assert torch.count_nonzero(model[0].weight[2:]) > 0


class _Zero(nn.Module):
    """Multiplies by zero: every gradient upstream is exactly zero, so only weight decay moves parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0


def test_weight_decay_shrinks_weights_but_not_biases_or_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 3), _Zero())
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    before = {k: v.clone() for k, v in model.named_parameters()}
    lr, decay = 0.1, 2.0
    # 32 samples in batches of 16: 2 steps; warmup 0 (one step) keeps the multiplier at 1 for both.
    fit(model, tiny_data(32), None, tiny_settings(epochs=1, lr=lr, weight_decay=decay, warmup=0.0, amp="off"),
        progress=False)
    shrink = (1 - lr * decay) ** 2
    after = dict(model.named_parameters())
    for name in ("0.weight", "3.weight"):
        assert torch.allclose(after[name], before[name] * shrink, rtol=1e-5, atol=1e-7), name
    for name in ("0.bias", "1.weight", "1.bias", "3.bias"):
        assert torch.equal(after[name], before[name]), name


def test_max_steps_stops_early_and_sizes_the_schedule():
    data = CountingData(tiny_data())
    # 6 steps an epoch: the cap ends the run 2 steps into epoch 2 of 3.
    result = fit(tiny_model(), data, tiny_data(), tiny_settings(epochs=3, max_steps=8), progress=False)
    assert len(data.batches) == 8
    assert [h["epoch"] for h in result.history] == [1, 2]
    assert result.history[0]["lr"] > 1e-4
    # The cosine reaches zero at the last step run, not at the 18 steps the epochs alone would take.
    assert result.history[-1]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_max_steps_above_the_epochs_changes_nothing():
    data = CountingData(tiny_data())
    result = fit(tiny_model(), data, None, tiny_settings(epochs=2, max_steps=1000), progress=False)
    assert len(data.batches) == 12 and len(result.history) == 2


def test_max_train_samples_trains_on_a_fixed_subset():
    data = CountingData(tiny_data())
    fit(tiny_model(), data, None, tiny_settings(epochs=5, max_train_samples=40), progress=False)
    # 40 samples in batches of 16 (the last partial batch dropped): 2 steps an epoch.
    assert len(data.batches) == 10 and all(len(b) == 16 for b in data.batches)
    seen = {i for batch in data.batches for i in batch}
    assert 32 < len(seen) <= 40
    again = CountingData(tiny_data())
    fit(tiny_model(), again, None, tiny_settings(epochs=5, max_train_samples=40), progress=False)
    assert {i for batch in again.batches for i in batch} <= set(capped(range(96), 40, seed=0))
    assert seen <= set(capped(range(96), 40, seed=0))


def test_capped_subset_is_seeded_random_and_sorted():
    data = list(range(96))
    first = list(capped(data, 40, seed=3))
    assert first == list(capped(data, 40, seed=3)) and first == sorted(first) and len(first) == 40
    assert first != list(range(40))
    assert list(capped(data, 40, seed=4)) != first
    assert capped(data, None, seed=3) is data and capped(data, 96, seed=3) is data


def test_too_few_samples_for_one_batch_is_an_error():
    with pytest.raises(TrainingError, match="lower --batch-size"):
        fit(tiny_model(), tiny_data(), None, tiny_settings(max_train_samples=8), progress=False)


def test_device_auto_trains_where_resolve_device_points():
    model = tiny_model()
    result = fit(model, tiny_data(), None, tiny_settings(epochs=1, device="auto"), progress=False)
    assert math.isfinite(result.history[0]["train_loss"])
    assert {p.device for p in model.parameters()} == {resolve_device("auto")}


def test_nan_loss_stops_with_one_line_error_and_keeps_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3))
    ckpt = tmp_path / "train.ckpt"
    with pytest.raises(TrainingError) as info:
        fit(model, tiny_data(), None, tiny_settings(lr=1e30, grad_clip=0.0, checkpoint=str(ckpt), checkpoint_every=1),
            progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "lower --lr" in message and str(ckpt) in message and "intact" in message
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state"]["step"] >= 1
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_modes_train_on_cpu(amp):
    result = fit(tiny_model(), tiny_data(), tiny_data(), tiny_settings(epochs=1, amp=amp), progress=False)
    assert math.isfinite(result.history[0]["train_loss"])


@pytest.mark.parametrize("bf16_supported, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_training_amp_auto_is_bf16_on_cuda_that_supports_it(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert training_dtype("auto", torch.device("cuda", 0)) == expected


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_training_amp_auto_is_off_without_cuda(device):
    assert training_dtype("auto", torch.device(device)) is None
    assert training_dtype("bf16", torch.device(device)) == torch.bfloat16
    assert training_dtype("fp16", torch.device(device)) == torch.float16
    assert training_dtype("off", torch.device(device)) is None


def test_training_amp_rejects_unknown_modes():
    with pytest.raises(ValueError, match="amp must be one of auto, bf16, fp16, off"):
        training_dtype("fp8", torch.device("cpu"))
