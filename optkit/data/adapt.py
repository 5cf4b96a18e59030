"""Fitting a dataset to a model's input: channels repeated or averaged, images resized, classes checked."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def check_fits(model: nn.Module, shape: tuple[int, ...], num_classes: int, data: str) -> None:
    """Check that ``model`` runs on ``data``'s samples at ``shape`` and has an output per class.

    Raises:
        DataError: naming the option that fixes it (``--input-shape``, ``--num-classes``).
    """
    import torch

    from optkit.core.errors import DataError
    from optkit.model.inputs import example_input

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(example_input(model, (2, *shape[1:])))
    except Exception as e:
        raise DataError(f"the model does not run on {data} samples shaped {tuple(shape[1:])} ({e}); "
                        "set --input-shape to what the model expects") from e
    finally:
        model.train(was_training)
    if outputs.dim() != 2 or outputs.shape[1] < num_classes:
        raise DataError(f"the model gives {tuple(outputs.shape[1:])} outputs per sample but {data} has "
                        f"{num_classes} classes; build it with --num-classes {num_classes}")


class AdaptedInputs:
    """A dataset view whose images are reshaped to the model's channels and size, a batch at a time.

    A grayscale image is repeated to 3 channels for a model that takes RGB (RGB
    is averaged for a grayscale model), and resized to the input's height and width.
    """

    def __init__(self, dataset, channels: int, size: tuple[int, int]):
        self.dataset, self.channels, self.size = dataset, channels, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        import torch

        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__(list(indices))
        else:
            samples = [self.dataset[i] for i in indices]
        images = adapt_images(torch.stack([image for image, _ in samples]), self.channels, self.size)
        return list(zip(images.unbind(0), [label for _, label in samples]))


def adapt_images(images, channels: int, size: tuple[int, int]):
    """A batch of images with ``channels`` channels and spatial ``size`` (see :class:`AdaptedInputs`).

    Raises:
        DataError: when neither the data's nor the model's channel count is 1 and they differ.
    """
    import torch.nn.functional as F

    from optkit.core.errors import DataError

    if images.shape[1] != channels:
        if images.shape[1] == 1:
            images = images.expand(-1, channels, -1, -1)
        elif channels == 1:
            images = images.mean(dim=1, keepdim=True)
        else:
            raise DataError(f"the data has {images.shape[1]}-channel images but the model takes {channels} "
                            "channels; set --input-shape to the model's input")
    if tuple(images.shape[-2:]) != tuple(size):
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
    return images.contiguous()


def adapted(dataset, shape: tuple[int, ...]):
    """``dataset`` as the model at input ``shape`` takes it (see :class:`AdaptedInputs`), or itself when it already fits."""
    if len(shape) != 4:
        return dataset
    image, _ = dataset[0]
    if image.shape[0] == shape[1] and tuple(image.shape[-2:]) == tuple(shape[2:]):
        return dataset
    return AdaptedInputs(dataset, shape[1], tuple(shape[2:]))
