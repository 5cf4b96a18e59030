"""Dataset specs (``fashion-mnist?mean=0&std=1``, ``imagefolder:DIR``...), tensor datasets and the tuned loader.

* :mod:`optkit.data.specs`: parsing a spec and its normalization query, :class:`DatasetInfo`;
* :mod:`optkit.data.datasets`: the readers, :class:`TensorImageDataset` and :func:`load_dataset`;
* :mod:`optkit.data.loader`: :func:`make_loader` and its measured worker count.
"""

from optkit.data.datasets import TensorImageDataset, check_available, load_dataset
from optkit.data.loader import LoaderChoice, make_loader, worker_candidates
from optkit.data.specs import QUERY_KEYS, DatasetInfo, DataSpec, dataset_info, parse_spec

__all__ = ["QUERY_KEYS", "DataSpec", "DatasetInfo", "LoaderChoice", "TensorImageDataset", "check_available", "dataset_info",
           "load_dataset", "make_loader", "parse_spec", "worker_candidates"]
