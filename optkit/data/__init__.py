"""Dataset specs (``fashion-mnist``, ``imagefolder:DIR``, ``synthetic:N``...), tensor datasets and the tuned loader."""

from optkit.data.datasets import (
    DatasetInfo,
    LoaderChoice,
    TensorImageDataset,
    dataset_info,
    load_dataset,
    make_loader,
    parse_spec,
    worker_candidates,
)

__all__ = ["DatasetInfo", "LoaderChoice", "TensorImageDataset", "dataset_info", "load_dataset", "make_loader",
           "parse_spec", "worker_candidates"]
