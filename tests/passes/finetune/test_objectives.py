"""Tests for optkit.passes.finetune.objectives: AdamW groups, the schedule, the distillation loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optkit.passes.finetune.objectives import cosine_with_warmup, distillation_loss, param_groups


def test_param_groups_decay_only_weights():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(16), nn.Linear(16, 2))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[4].weight)}
    expected = [model[0].bias, model[1].weight, model[1].bias, model[3].weight, model[3].bias, model[4].bias]
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in expected}


def test_param_groups_leave_out_frozen_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    assert {id(p) for p in decay["params"]} == {id(model[1].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].bias)}


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
