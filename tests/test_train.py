"""Tests for optkit.passes.finetune.loop: optimizer groups, schedule, distillation, resume after SIGKILL, NaN handling."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from optkit.core.errors import TrainingError
from optkit.passes.finetune.loop import TrainConfig, cosine_with_warmup, distillation_loss, evaluate, fit, param_groups

ROOT = Path(__file__).resolve().parent.parent


def tiny_data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    y = (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1)
    return TensorDataset(x, y)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.2), nn.Linear(144, 3))


def test_param_groups_decay_only_weights():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(16), nn.Linear(16, 2))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[4].weight)}
    expected = [model[0].bias, model[1].weight, model[1].bias, model[3].weight, model[3].bias, model[4].bias]
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in expected}


def test_cosine_schedule_warms_up_then_decays_to_zero():
    factor = cosine_with_warmup(total_steps=100, warmup_steps=10)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.5, abs=1e-9)
    assert factor(100) == pytest.approx(0.0, abs=1e-12)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 100))


def test_distillation_loss_mixes_label_and_teacher_terms():
    torch.manual_seed(0)
    student, teacher = torch.randn(8, 5), torch.randn(8, 5)
    labels = torch.randint(0, 5, (8,))
    ce = F.cross_entropy(student, labels)
    assert distillation_loss(student, teacher, labels, temperature=4.0, alpha=0.0) == pytest.approx(ce.item(), rel=1e-6)
    # Matching the teacher exactly leaves only the label term.
    same = distillation_loss(student, student.clone(), labels, temperature=3.0, alpha=0.7)
    assert same.item() == pytest.approx(0.3 * ce.item(), rel=1e-5)
    t = 2.0
    kl = F.kl_div(F.log_softmax(student / t, -1), F.softmax(teacher / t, -1), reduction="batchmean")
    pure = distillation_loss(student, teacher, labels, temperature=t, alpha=1.0)
    assert pure.item() == pytest.approx(t * t * kl.item(), rel=1e-5)
    # Its gradient moves the student's softened distribution toward the teacher's.
    s = student.clone().requires_grad_(True)
    distillation_loss(s, teacher, labels, temperature=t, alpha=1.0).backward()
    with torch.no_grad():
        after = distillation_loss(s - 0.5 * s.grad, teacher, labels, temperature=t, alpha=1.0)
    assert after < pure


def test_fit_learns_and_keeps_best_epoch():
    data = tiny_data()
    model = tiny_model()
    before = evaluate(model, data)["accuracy"]
    result = fit(model, data, data, TrainConfig(epochs=4, batch_size=16, lr=1e-2, num_workers=0, progress=False))
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
    fit(model, tiny_data(), None, TrainConfig(epochs=1, batch_size=16, lr=1e-2, num_workers=0, progress=False))
    assert torch.count_nonzero(model[0].weight[:2]) == 0
    assert torch.count_nonzero(model[0].weight[2:]) > 0


_RESUME_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_train import tiny_data, tiny_model, resume_config
    from optkit.passes.finetune.loop import fit

    torch.set_num_threads(1)
    data = tiny_data()
    kill_at = int(sys.argv[2])

    class Killing(torch.utils.data.Dataset):
        calls = 0
        def __len__(self):
            return len(data)
        def __getitem__(self, i):
            return data[i]
        def __getitems__(self, indices):
            Killing.calls += 1
            if Killing.calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return [data[i] for i in indices]

    result = fit(tiny_model(), Killing(), data, resume_config(sys.argv[1], resume=kill_at == 0))
    torch.save(result.model.state_dict(), sys.argv[1] + ".final")
""")


def resume_config(checkpoint: str, resume: bool) -> TrainConfig:
    return TrainConfig(epochs=3, batch_size=16, lr=5e-3, amp="off", checkpoint=checkpoint, checkpoint_every=4,
                       resume=resume, num_workers=0, progress=False, seed=7)


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RESUME_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ckpt = str(tmp_path / "train.ckpt")
    # 6 batches an epoch: batch 10 is mid-way through epoch 2, two batches after the step-8 checkpoint.
    killed = subprocess.run([sys.executable, str(script), ckpt, "10"], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state"]["epoch"] == 1 and saved["state"]["step"] == 8 and saved["state"]["position"] == 32

    resumed = subprocess.run([sys.executable, str(script), ckpt, "0"], env=env, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    fresh = str(tmp_path / "fresh.ckpt")
    uninterrupted = subprocess.run([sys.executable, str(script), fresh, "-1"], env=env, capture_output=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr.decode()[-2000:]

    a = torch.load(ckpt + ".final", weights_only=True)
    b = torch.load(fresh + ".final", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=1e-6), key
    last_a, last_b = torch.load(ckpt, weights_only=True), torch.load(fresh, weights_only=True)
    assert last_a["state"]["history"] == last_b["state"]["history"]
    for key in last_a["model"]:
        assert torch.allclose(last_a["model"][key].float(), last_b["model"][key].float(), rtol=0, atol=1e-6), key


def test_nan_loss_stops_with_one_line_error_and_keeps_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3))
    ckpt = tmp_path / "train.ckpt"
    config = TrainConfig(epochs=2, batch_size=16, lr=1e30, grad_clip=0.0, checkpoint=str(ckpt), checkpoint_every=1,
                         num_workers=0, progress=False)
    with pytest.raises(TrainingError) as info:
        fit(model, tiny_data(), None, config)
    message = str(info.value)
    assert "\n" not in message
    assert "lower --lr" in message and str(ckpt) in message and "intact" in message
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state"]["step"] >= 1
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_resume_refuses_checkpoint_from_other_settings(tmp_path):
    ckpt = str(tmp_path / "train.ckpt")
    base = dict(epochs=1, batch_size=16, num_workers=0, progress=False, checkpoint=ckpt)
    fit(tiny_model(), tiny_data(), None, TrainConfig(lr=1e-3, **base))
    with pytest.raises(TrainingError, match="lr=0.001"):
        fit(tiny_model(), tiny_data(), None, TrainConfig(lr=2e-3, resume=True, **base))


def test_resume_of_finished_run_restores_best_weights(tmp_path):
    ckpt = str(tmp_path / "train.ckpt")
    config = TrainConfig(epochs=2, batch_size=16, lr=1e-2, num_workers=0, progress=False, checkpoint=ckpt)
    first = fit(tiny_model(), tiny_data(), tiny_data(), config)
    again = fit(tiny_model(), tiny_data(), tiny_data(), TrainConfig(**{**config.__dict__, "resume": True}))
    assert again.history == first.history and again.best_epoch == first.best_epoch
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_modes_train_on_cpu(amp):
    result = fit(tiny_model(), tiny_data(), tiny_data(),
                 TrainConfig(epochs=1, batch_size=16, lr=1e-2, amp=amp, num_workers=0, progress=False))
    assert math.isfinite(result.history[0]["train_loss"])
