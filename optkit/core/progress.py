"""Progress of long work inside a pass (blocks pruned, plans scored, batches evaluated), shown as it happens.

Library code reports through :func:`progress`; nothing is shown until a front end installs a sink with
:func:`show_progress` (the CLI prints each line). Lines are throttled to one every :data:`INTERVAL_S`
seconds, except the last of a count, and carry the count, the elapsed time and an estimate of the time left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["INTERVAL_S", "Progress", "progress", "show_progress"]

#: The least time between two lines of one count.
INTERVAL_S = 2.0

_sink: ContextVar[Callable[[str], None] | None] = ContextVar("optkit_progress_sink", default=None)


class Progress:
    """A count of ``total`` steps of ``what`` within ``stage``; :meth:`step` after each one."""

    def __init__(self, stage: str, what: str, total: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.what, self.total, self.done = stage, what, total, 0
        self._clock = clock
        self._start = self._last = clock()

    def step(self, count: int = 1, detail: str = "") -> None:
        """Count ``count`` more steps done; show a line when due (and always for the last step)."""
        self.done += count
        sink = _sink.get()
        now = self._clock()
        if sink is None or (now - self._last < INTERVAL_S and self.done < self.total):
            return
        self._last = now
        sink(self.line(now, detail))

    def finish(self) -> None:
        """The work ended before ``total`` steps (it had measured enough): what was done is the total; show it."""
        self.total = self.done
        self._last = -INTERVAL_S
        self.step(0)

    def line(self, now: float, detail: str = "") -> str:
        """``stage: what done/total, elapsed s, about N s left (detail)``."""
        elapsed = now - self._start
        text = f"{self.stage}: {self.what} {self.done}/{self.total}, {elapsed:.0f} s"
        if 0 < self.done < self.total:
            text += f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        return text + (f" ({detail})" if detail else "")


def progress(stage: str, what: str, total: int) -> Progress:
    """A count to report progress on (shown only where a sink is installed)."""
    return Progress(stage, what, total)


@contextmanager
def show_progress(sink: Callable[[str], None]) -> Iterator[None]:
    """Within the block, progress lines go to ``sink`` (one line each, without a newline)."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)
