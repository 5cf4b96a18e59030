"""BatchNorm: insert after convolutions (function-preserving), fold into them, recalibrate statistics.

The folding engine, :func:`fold_batchnorm`, lives on the ground floor (:mod:`optkit.model.batchnorm`), where
export uses it too.
"""

from optkit.model.batchnorm import fold_batchnorm
from optkit.passes.batchnorm.passes import (
    FoldBatchNorm,
    InsertBatchNorm,
    RecalibrateBatchNorm,
    insert_batchnorm,
    recalibrate_batchnorm,
)

__all__ = ["FoldBatchNorm", "InsertBatchNorm", "RecalibrateBatchNorm", "fold_batchnorm", "insert_batchnorm",
           "recalibrate_batchnorm"]
