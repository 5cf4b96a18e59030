"""Give memory back to the system while a model's weights are replaced in place.

A model loaded from safetensors is memory-mapped: each weight is a range of the file's pages, resident once
read. When a pass gives a module new weights (block-by-block pruning converts every block to fp32 and back),
the old pages stay mapped, and count in the process's resident set, until the whole file is unmapped: a
1 B-parameter bf16 model pruned block by block would hold the checkpoint twice. :func:`file_storages` notes a
module's storages that lie in a file mapping before they are replaced; :func:`release` then drops the pages of
those no tensor uses any more (``madvise(MADV_DONTNEED)``; a file page dropped is read again from the file if
ever touched) and hands freed heap memory back (``malloc_trim``). Linux only; elsewhere both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import mmap
import sys

import torch
from torch import nn

__all__ = ["evict_clean", "file_storages", "release"]

_MADV_DONTNEED = 4
#: /proc/self/pagemap entry bits: the page is present; it is a file page (not a private copy made by a write).
_PRESENT, _FILE_PAGE = 1 << 63, 1 << 61


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process has mapped from files (``/proc/self/maps`` entries with a path)."""
    spans = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    spans.append((start, end))
    except OSError:
        return []
    return spans


def file_storages(module: nn.Module) -> list[torch.UntypedStorage]:
    """The storages of ``module``'s parameters and buffers that lie in memory mapped from a file."""
    if _libc() is None or not hasattr(torch._C, "_storage_Use_Count"):
        return []
    spans = _file_mappings()
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if size and any(low <= start and start + size <= high for low, high in spans):
            found[start] = storage
    return list(found.values())


def evict_clean(module: nn.Module) -> int:
    """Drop the resident file pages of ``module``'s weights that still hold the file's bytes (never written).

    They stay in the system's page cache and are read back from it (or from the file) when next touched: a
    block-by-block pass then holds in its own resident set only the blocks it has reached. A page a write made
    private (the weights changed in place after loading) is kept: dropping it would lose the change.

    Returns:
        the bytes dropped.
    """
    libc = _libc()
    if libc is None:
        return 0
    page = mmap.PAGESIZE
    dropped = 0
    try:
        pagemap = open("/proc/self/pagemap", "rb")  # noqa: SIM115 - read below, closed in finally
    except OSError:
        return 0
    try:
        for storage in file_storages(module):
            first = -(-storage.data_ptr() // page)
            last = (storage.data_ptr() + storage.nbytes()) // page
            if last <= first:
                continue
            pagemap.seek(first * 8)
            entries = memoryview(pagemap.read((last - first) * 8)).cast("Q")
            run_start = None
            for index in range(len(entries) + 1):
                clean = index < len(entries) and entries[index] & (_PRESENT | _FILE_PAGE) == _PRESENT | _FILE_PAGE
                if clean and run_start is None:
                    run_start = index
                elif not clean and run_start is not None:
                    dropped += _drop(libc, (first + run_start) * page, (first + index) * page)
                    run_start = None
    finally:
        pagemap.close()
    return dropped


def release(storages: list[torch.UntypedStorage]) -> int:
    """Drop the resident pages of the storages in ``storages`` that no tensor uses any more, then trim the heap.

    A storage some tensor still uses is left alone and stays in ``storages`` (to try again after its next change);
    the others are removed from it, so they are freed.

    Returns:
        the bytes of file pages dropped.
    """
    libc = _libc()
    released = 0
    page = mmap.PAGESIZE
    in_use = []
    for storage in storages:
        if libc is None or torch._C._storage_Use_Count(storage._cdata) != 1:
            in_use.append(storage)  # held elsewhere (a view, a tied weight): its pages are still read
            continue
        # Whole pages only: the partial pages at either end may hold a neighbouring tensor's bytes.
        released += _drop(libc, -(-storage.data_ptr() // page) * page,
                          (storage.data_ptr() + storage.nbytes()) // page * page)
    storages[:] = in_use
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return released


def _drop(libc: ctypes.CDLL, start: int, end: int) -> int:
    """``madvise(MADV_DONTNEED)`` the pages in ``[start, end)`` (page-aligned); the bytes dropped."""
    if end <= start or libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
        return 0
    return end - start
