"""A wall-clock limit for work that may never finish (torch-pruning's graph loops).

The limit uses ``SIGALRM``, which interrupts pure-Python loops such as
torch-pruning's index mapping. Signals only work in the main thread of a
POSIX process; elsewhere the work runs without a limit and the caller is told.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


class TimeLimitExceeded(Exception):
    """Raised inside the limited block when its time is up."""


def limit_available() -> bool:
    """Whether :func:`time_limit` can enforce a limit here (main thread, POSIX signals)."""
    return hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[bool]:
    """Raise :class:`TimeLimitExceeded` in the block after ``seconds``.

    Args:
        seconds: the limit; ``None`` or 0 means no limit.

    Yields:
        whether the limit is enforced (False where signals are unavailable).

    Limits nest: an enclosing limit keeps counting inside this one and fires
    as soon as this one ends if its own time ran out meanwhile.
    """
    if not seconds or not limit_available():
        yield False
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(f"did not finish within {seconds:g} s")

    previous_handler = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    if previous_delay and previous_delay < seconds:
        signal.setitimer(signal.ITIMER_REAL, previous_delay)
        expire = _outer_first(expire, previous_handler)
        signal.signal(signal.SIGALRM, expire)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            remaining = max(previous_delay - (time.monotonic() - started), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


def _outer_first(inner, outer):
    # The enclosing limit ends first: its handler (and message) decide.
    def expire(signum, frame):
        if callable(outer):
            outer(signum, frame)
        inner(signum, frame)
    return expire
