"""Top-1 accuracy of a model on a dataset, and a warning when it is no better than guessing.

A model scored under another input normalization than it was trained with
(say, trained on plain 0-1 tensors, scored on standardized ones) lands near
chance; so does a model with random weights. :func:`chance_warning` says so
in one line, before any training builds on the figure.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

#: How far above chance (1 / classes, absolute) an accuracy still counts as guessing.
CHANCE_MARGIN = 0.05


def top1_accuracy(model: nn.Module, dataset: Dataset, *, batch_size: int = 256,
                  max_samples: int | None = None) -> float:
    """The fraction of ``dataset`` whose label is the model's highest logit.

    The model runs in eval mode without gradients, on the device it is on;
    its train/eval mode is restored afterwards.

    Args:
        model: a classifier returning logits ``N×K``.
        dataset: yields ``(image, label)`` pairs shaped as the model takes them
            (adapt channels and size first, as the fine-tune pass does).
        batch_size: samples per forward pass.
        max_samples: score only the first this many samples (all by default).

    Returns:
        the top-1 accuracy, between 0 and 1.

    Raises:
        ValueError: for a non-positive ``batch_size`` or ``max_samples``, an
            empty dataset, or a model whose output is not a 2-D logits tensor.
    """
    from optkit.kinds import model_device
    from optkit.model.state import eval_mode

    if batch_size < 1 or (max_samples is not None and max_samples < 1):
        raise ValueError(f"batch_size and max_samples must be positive, got {batch_size} and {max_samples}")
    if max_samples is not None and max_samples < len(dataset):
        dataset = Subset(dataset, range(max_samples))
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: there is nothing to score")
    device = model_device(model)
    correct = seen = 0
    with eval_mode(model), torch.no_grad():
        for inputs, labels in DataLoader(dataset, batch_size=batch_size):
            logits = model(inputs.to(device))
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(f"top-1 accuracy needs a classifier returning N x K logits, got {got}")
            correct += int((logits.argmax(1).cpu() == labels).sum())
            seen += len(labels)
    return correct / seen


def near_chance(accuracy: float, num_classes: int, margin: float = CHANCE_MARGIN) -> bool:
    """Whether ``accuracy`` is no better than guessing among ``num_classes``.

    Args:
        accuracy: a top-1 accuracy between 0 and 1.
        num_classes: how many labels there are (chance is ``1 / num_classes``).
        margin: how far above chance, absolute, still counts (default 5 points).

    Returns:
        ``accuracy <= 1 / num_classes + margin``.

    Raises:
        ValueError: for fewer than 2 classes or a negative margin.
    """
    if num_classes < 2 or margin < 0:
        raise ValueError(f"need num_classes >= 2 and margin >= 0, got {num_classes} and {margin}")
    return accuracy <= 1 / num_classes + margin


def chance_warning(accuracy: float, num_classes: int, spec: str, *, what: str = "the original model",
                   margin: float = CHANCE_MARGIN, random_weights: str | None = None) -> str | None:
    """A one-line warning when ``accuracy`` on the dataset ``spec`` is near chance, else ``None``.

    A model whose weights are random by design (``random_weights`` says why, e.g. ``"torchvision:resnet18 has
    random weights (nothing is downloaded)"``) scores near chance as expected: the line then says so, and
    nothing about the data.

    The usual cause with trained weights is a normalization other than the
    one the model was trained with, so the line names the spec that changes
    it: ``?mean=0&std=1`` (plain 0-1 tensors), or the dataset's own
    statistics when the spec already asks for 0-1.

    Args:
        accuracy: the model's top-1 accuracy on ``spec``.
        num_classes: the dataset's classes.
        spec: the dataset spec it was scored on.
        what: how the message names the model.
        margin: as for :func:`near_chance`.
        random_weights: why the model's weights are random, when they are (:func:`optkit.io.weights.random_weights`).

    Returns:
        e.g. ``"the original model scores 9.7% on fashion-mnist, near chance (10%): check the
        data's normalization (now mean 0.286, std 0.353), e.g. fashion-mnist?mean=0&std=1"``, or ``None``.

    Raises:
        DataError: for a bad spec.
        ValueError: as for :func:`near_chance`.
    """
    from optkit.data.specs import dataset_info, parse_spec

    if not near_chance(accuracy, num_classes, margin):
        return None
    if random_weights:
        return (f"{what} scores {_percent(accuracy)} on {spec}, chance level ({_percent(1 / num_classes)}), as "
                f"expected: {random_weights}")
    base = parse_spec(spec).base
    info = dataset_info(spec)
    already_plain = all(m == 0 for m in info.mean) and all(s == 1 for s in info.std)
    suggested = dataset_info(base).normalization() if already_plain else {"mean": "0", "std": "1"}
    now = info.normalization()
    return (f"{what} scores {_percent(accuracy)} on {spec}, near chance ({_percent(1 / num_classes)}): "
            f"check the data's normalization (now mean {now['mean']}, std {now['std']}), "
            f"e.g. {base}?mean={suggested['mean']}&std={suggested['std']}")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"
