"""The module :func:`optkit.passes.batchnorm.passes.insert_batchnorm` puts in place of a convolution.

Kept apart from the pass module because defining an ``nn.Module`` class needs
torch at import time, and pass modules must stay importable without it.
"""

from __future__ import annotations

from torch import nn


class ConvBatchNorm(nn.Sequential):
    """A convolution followed by the BatchNorm inserted after it: ``Sequential(conv, bn)``.

    A plain subclass of ``nn.Sequential`` (children ``0`` and ``1``), so optkit's
    slimmed checkpoint can rebuild it, torch.fx traces through it, and
    :func:`optkit.model.batchnorm.fold_batchnorm` folds the pair like any other.

    Args:
        conv: the original convolution.
        bn: the BatchNorm that normalizes its output.
    """

    def __init__(self, conv: nn.Module, bn: nn.Module):
        super().__init__(conv, bn)
