"""Architectures the user confirmed, remembered for the checkpoints optkit wrote from them.

Loading a slimmed checkpoint whose architecture is the user's own class
(``package.module:Class``) imports that module, which runs its code; so a
checkpoint may name such a module only when the user confirms it with
``--arch``. A checkpoint optkit itself wrote in a run where the user had
confirmed the architecture is remembered here by the SHA-256 of its bytes, so
later commands on that same file need no ``--arch``. A file made or changed
anywhere else has another hash and still needs the confirmation.

The record lives in the per-user cache (:func:`optkit.core.files.cache_dir`), never
beside the checkpoint, where whoever ships the file could ship it too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from optkit.core.files import cache_dir, write_text

_FILE = "confirmed-architectures.json"


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remember(path: str | os.PathLike, spec: str) -> None:
    """Record that the checkpoint at ``path`` (as it is now) was written from the confirmed architecture ``spec``."""
    records = _read()
    records[file_digest(path)] = spec
    write_text(cache_dir() / _FILE, json.dumps(records, indent=1, sort_keys=True) + "\n")


def confirmed_spec(path: str | os.PathLike) -> str | None:
    """The architecture confirmed for the checkpoint at ``path``, or ``None`` when this file was never recorded."""
    if not Path(path).is_file():
        return None
    return _read().get(file_digest(path))


def _read() -> dict[str, str]:
    try:
        data = json.loads((cache_dir() / _FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
