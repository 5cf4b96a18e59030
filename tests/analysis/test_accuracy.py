"""Tests for optkit/analysis/accuracy.py: top-1 accuracy and the near-chance warning."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from optkit.analysis.accuracy import chance_warning, near_chance, top1_accuracy
from optkit.data import dataset_info, load_dataset


def _known_accuracy_data(n: int = 100, classes: int = 5, correct: int = 37) -> TensorDataset:
    """Inputs are one-hot logits; the first ``correct`` labels agree with them, the rest do not."""
    predicted = torch.arange(n) % classes
    labels = torch.where(torch.arange(n) < correct, predicted, (predicted + 1) % classes)
    return TensorDataset(nn.functional.one_hot(predicted, classes).float(), labels)


def test_top1_accuracy_of_a_model_whose_accuracy_is_known():
    model = nn.Identity()
    data = _known_accuracy_data()
    assert top1_accuracy(model, data, batch_size=16) == pytest.approx(0.37, abs=1e-12)
    assert top1_accuracy(model, data, batch_size=256) == pytest.approx(0.37, abs=1e-12)
    assert top1_accuracy(model, data, batch_size=7, max_samples=50) == pytest.approx(37 / 50, abs=1e-12)
    assert top1_accuracy(model, data, max_samples=1000) == pytest.approx(0.37, abs=1e-12)


def test_top1_accuracy_restores_the_train_mode_and_needs_no_grad():
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.9), nn.Identity()).train()
    data = _known_accuracy_data(correct=100)
    # Dropout at p=0.9 would scramble the argmax if the model were scored in train mode.
    assert top1_accuracy(model, data) == 1.0
    assert model.training


def test_top1_accuracy_rejects_bad_arguments():
    data = _known_accuracy_data()
    with pytest.raises(ValueError, match="positive"):
        top1_accuracy(nn.Identity(), data, batch_size=0)
    with pytest.raises(ValueError, match="N x K logits"):
        top1_accuracy(nn.Unflatten(1, (5, 1)), data)
    with pytest.raises(ValueError, match="empty"):
        top1_accuracy(nn.Identity(), TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)))


def test_a_briefly_trained_model_is_not_near_chance():
    torch.manual_seed(0)
    spec = "synthetic:512:1x8x8:4?mean=0&std=1"
    train, test = load_dataset(spec, "train", augment=False), load_dataset(spec, "test")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(5):
        for images, labels in torch.utils.data.DataLoader(train, batch_size=64, shuffle=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    accuracy = top1_accuracy(model, test)
    assert accuracy >= 0.9
    assert not near_chance(accuracy, 4) and chance_warning(accuracy, 4, spec) is None


def test_a_constant_model_scores_chance_and_is_warned_about():
    test = load_dataset("synthetic:400:1x4x4:4", "test")
    counts = torch.bincount(test.labels, minlength=4)
    rarest = int(counts.argmin())  # so its share is at most 1/4, whatever the labels drawn
    constant = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    with torch.no_grad():
        constant[1].weight.zero_()
        constant[1].bias.copy_(nn.functional.one_hot(torch.tensor(rarest), 4).float())
    accuracy = top1_accuracy(constant, test)
    assert accuracy == pytest.approx(int(counts[rarest]) / 400, abs=1e-12)
    assert near_chance(accuracy, 4)
    warning = chance_warning(accuracy, 4, "synthetic:400:1x4x4:4")
    assert warning.startswith(f"the original model scores {100 * accuracy:.3g}% on synthetic:400:1x4x4:4, "
                              "near chance (25%)")


@pytest.mark.parametrize(("accuracy", "classes", "near"), [
    (0.10, 10, True), (0.149, 10, True), (0.151, 10, False), (0.0, 10, True), (0.549, 2, True), (0.551, 2, False),
])
def test_near_chance_is_within_five_points_of_one_over_classes(accuracy, classes, near):
    assert near_chance(accuracy, classes) is near


def test_near_chance_rejects_a_single_class():
    with pytest.raises(ValueError, match="num_classes >= 2"):
        near_chance(0.5, 1)


def test_chance_warning_names_the_normalization_to_try():
    assert chance_warning(0.097, 10, "fashion-mnist") == (
        "the original model scores 9.7% on fashion-mnist, near chance (10%): check the data's normalization "
        "(now mean 0.286, std 0.353), e.g. fashion-mnist?mean=0&std=1")
    already_plain = chance_warning(0.1, 10, "fashion-mnist?mean=0&std=1", what="the model")
    assert already_plain.startswith("the model scores 10% on fashion-mnist?mean=0&std=1")
    assert already_plain.endswith("(now mean 0, std 1), e.g. fashion-mnist?mean=0.286&std=0.353")
    rgb = chance_warning(0.26, 4, "synthetic:8:3x4x4:4?mean=0&std=1")
    default = dataset_info("synthetic:8:3x4x4:4")
    assert rgb.endswith(f"e.g. synthetic:8:3x4x4:4?mean={','.join(['0.5'] * 3)}&std={','.join(['0.25'] * 3)}")
    assert default.mean == (0.5,) * 3
    assert "\n" not in rgb and chance_warning(0.5, 10, "fashion-mnist") is None
