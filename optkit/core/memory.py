"""Peak memory of a stage of a run: the process's resident set size (RSS) at its highest within a block.

:class:`PeakRss` measures one block; blocks may nest and overlap (a run's stage holds its passes'
blocks). Two sources are combined:

* ``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark of the process's RSS since it
  started: when it rose within the block, the block's peak *is* the new high-water mark (exact);
* otherwise the block stayed below an earlier peak, and its peak is the largest RSS read every
  :data:`INTERVAL_S` seconds by one sampling thread (``/proc/self/statm``, else ``psutil`` where
  installed) while any block is open, so a spike shorter than the interval can be missed there.

The kernel's high-water mark is never reset (``/proc/self/clear_refs``): a parent timing this process
(``/usr/bin/time``, ``RUSAGE_CHILDREN``) still reads the true peak. Stdlib only; no torch.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

__all__ = ["INTERVAL_S", "METHOD", "PeakRss", "current_rss", "peak_rss"]

#: Seconds between two RSS samples while a block is open.
INTERVAL_S = 0.02
#: How the figures are measured, in words (for reports).
METHOD = (f"process RSS high-water mark (getrusage ru_maxrss) where the stage raised it, else the largest RSS "
          f"sampled every {INTERVAL_S * 1000:.0f} ms in a thread")
_MB = 1024 * 1024

try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _PAGE = 4096


def current_rss() -> int | None:
    """This process's resident set size in bytes now, or ``None`` where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int | None:
    """The process's RSS high-water mark since it started, in bytes (``ru_maxrss``), or ``None`` off POSIX."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024  # bytes on macOS, KiB on Linux


class _Sampler:
    """One daemon thread that reads the RSS while any :class:`PeakRss` block is open and raises their peaks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[PeakRss] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, block: PeakRss) -> None:
        with self._lock:
            self._open.add(block)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="optkit-peak-rss", daemon=True)
                self._thread.start()
            self._wake.set()

    def remove(self, block: PeakRss) -> None:
        with self._lock:
            self._open.discard(block)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                blocks = list(self._open)
                if not blocks:
                    self._wake.clear()  # under the lock: a block opening now sets it again
                    continue
            rss = current_rss()
            if rss is not None:
                for block in blocks:
                    block._see(rss)
            time.sleep(INTERVAL_S)


_SAMPLER = _Sampler()


class PeakRss:
    """The process's peak RSS while in a ``with`` block (see the module docstring).

    Attributes:
        peak: bytes at the highest point within the block (``None`` before it ends or where RSS cannot be read).
        start, end: RSS in bytes when the block began and ended.
        exact: whether :attr:`peak` is the kernel's high-water mark (the block raised it) rather than a sample.
        seconds: the block's wall time.
    """

    def __init__(self) -> None:
        self.peak: int | None = None
        self.start: int | None = None
        self.end: int | None = None
        self.exact = False
        self.seconds = 0.0
        self._sampled = 0
        self._mark: int | None = None
        self._began = 0.0

    def __enter__(self) -> PeakRss:
        self._began = time.perf_counter()
        self._mark = peak_rss()
        self.start = current_rss()
        self._sampled = self.start or 0
        _SAMPLER.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _SAMPLER.remove(self)
        self.end = current_rss()
        self.seconds = time.perf_counter() - self._began
        mark = peak_rss()
        sampled = max(self._sampled, self.end or 0)
        if mark is not None and self._mark is not None and mark > self._mark:
            self.peak, self.exact = max(mark, sampled), True
        else:
            self.peak = sampled or None

    def _see(self, rss: int) -> None:
        if rss > self._sampled:
            self._sampled = rss

    @property
    def peak_mb(self) -> float | None:
        """:attr:`peak` in MiB, rounded to 0.1 (``None`` when unknown)."""
        return None if self.peak is None else round(self.peak / _MB, 1)

    def to_dict(self) -> dict[str, Any]:
        """``peak_rss_mb``, ``start_rss_mb``, ``end_rss_mb`` (MiB), ``exact`` and ``seconds``."""
        def mb(value: int | None) -> float | None:
            return None if value is None else round(value / _MB, 1)

        return {"peak_rss_mb": self.peak_mb, "start_rss_mb": mb(self.start), "end_rss_mb": mb(self.end),
                "exact": self.exact, "seconds": round(self.seconds, 3)}
