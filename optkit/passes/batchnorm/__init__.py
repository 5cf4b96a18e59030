"""BatchNorm: insert after convolutions (function-preserving), fold into them, recalibrate statistics."""

from optkit.passes.batchnorm.passes import (
    FoldBatchNorm,
    InsertBatchNorm,
    RecalibrateBatchNorm,
    fold_batchnorm,
    insert_batchnorm,
    recalibrate_batchnorm,
)

__all__ = ["FoldBatchNorm", "InsertBatchNorm", "RecalibrateBatchNorm", "fold_batchnorm", "insert_batchnorm",
           "recalibrate_batchnorm"]
