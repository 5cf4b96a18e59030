"""Atomic file writes: a failed or interrupted run never leaves a half-written output."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it into place only on success.

    The temporary file lives in the target folder so the final ``os.replace``
    is atomic on POSIX. On any exception (including KeyboardInterrupt) the
    temporary file is removed and ``path`` keeps its previous content.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    # mkstemp creates the file 0600; give it the permissions a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def cache_dir() -> Path:
    """optkit's per-user cache folder: ``$OPTKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/optkit`` (``~/.cache/optkit``)."""
    base = os.environ.get("OPTKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "optkit")
    return Path(base)
