"""The fixed split of a dataset's files into ``train``, ``val`` and ``test``, by a hash of each file's name.

A file's name (its path relative to the dataset folder, with ``/``) is hashed
(SHA-256) to a number in [0, 1): below 0.90 the file is in ``train``, below
0.95 in ``val``, else in ``test``. A file's split depends on its name alone, so
adding or removing files never moves the others. Text specs split their files
this way (:mod:`optkit.data.text`), segmentation and detection folders their
images (:func:`split_names`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from optkit.core.errors import DataError

__all__ = ["SPLIT_BOUNDS", "name_share", "name_split", "split_names"]

#: Upper ends of the train and val shares of [0, 1); the rest is test.
SPLIT_BOUNDS = {"train": 0.90, "val": 0.95, "test": 1.0}


def name_share(name: str) -> float:
    """Where ``name`` falls in [0, 1): the first 8 bytes of its SHA-256, as a fraction."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def name_split(name: str) -> str:
    """The split a file of this (relative) name is in: ``train``, ``val`` or ``test``."""
    share = name_share(name)
    return next(split for split, bound in SPLIT_BOUNDS.items() if share < bound)


def split_names(names: Sequence[str], split: str, where: str) -> list[str]:
    """The names of ``split``, in sorted order: by :func:`name_split`, or by order in a small folder.

    When the hash leaves a split without a file (a folder of a few dozen files or
    fewer), the sorted names are split by position instead: the last 5 % (at least
    one) are ``test``, the 5 % before them (at least one) ``val``, the rest ``train``.

    Args:
        names: the files' names relative to the dataset folder.
        split: ``train``, ``val`` or ``test``.
        where: the dataset, for messages (``segfolder:DIR``).

    Raises:
        DataError: for a bad split, or fewer than 3 files (one per split).
    """
    if split not in SPLIT_BOUNDS:
        raise DataError(f"split must be one of {', '.join(SPLIT_BOUNDS)}; got {split!r}")
    ordered = sorted(names)
    by_hash = {s: [name for name in ordered if name_split(name) == s] for s in SPLIT_BOUNDS}
    if all(by_hash.values()):
        return by_hash[split]
    if len(ordered) < len(SPLIT_BOUNDS):
        raise DataError(f"{where} has {len(ordered)} image(s); it needs at least {len(SPLIT_BOUNDS)}, one per split "
                        f"({', '.join(SPLIT_BOUNDS)})")
    held = max(1, round(len(ordered) * (1 - SPLIT_BOUNDS["val"])))
    val_start = len(ordered) - 2 * held
    bounds = {"train": (0, val_start), "val": (val_start, val_start + held), "test": (val_start + held, len(ordered))}
    start, end = bounds[split]
    return ordered[start:end]
