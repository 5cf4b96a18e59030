"""Recipe format versions: every recipe written says ``version = N``; older ones are migrated when read.

Version 1 is the format before recipes carried a version (the one in every
``model.pt`` written until then), so a recipe without the key is version 1.
Each migration turns one version's parsed mapping into the next one's; a
recipe newer than :data:`VERSION` is refused, since its meaning is unknown here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optkit.core.errors import RecipeError

#: The version this optkit writes and reads.
VERSION = 2
#: The version of a recipe that has no ``version`` key.
UNVERSIONED = 1


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept INT8 in an ``[int8]`` table read by ``--export onnx``; version 2 has export and INT8 steps."""
    migrated = {k: v for k, v in data.items() if k != "int8"}
    if "int8" in data:
        table = data["int8"]
        if not isinstance(table, dict):
            raise RecipeError("int8 must be an [int8] table")
        migrated["pass"] = [*data.get("pass", []), {"name": "export_onnx"}, {"name": "int8", **table}]
    return migrated


#: ``MIGRATIONS[n]`` turns a version-``n`` mapping into a version ``n + 1`` one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def upgrade(data: dict[str, Any], source: str, *, default: int = UNVERSIONED) -> tuple[dict[str, Any], str | None]:
    """Bring a parsed recipe mapping to :data:`VERSION`.

    Args:
        data: the recipe as parsed TOML (not changed).
        source: where it came from, for messages.
        default: the version of a mapping without a ``version`` key.

    Returns:
        the mapping in the current format (its ``version`` removed), and a one-line note saying it was
        migrated (``None`` when it was current already).

    Raises:
        RecipeError: if the version is not a whole number from 1, or is newer than :data:`VERSION`.
    """
    version = data.get("version", default)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise RecipeError(f"{source}: version must be a whole number from 1 to {VERSION}; got {version!r}")
    if version > VERSION:
        raise RecipeError(f"{source} is a version {version} recipe, but this optkit reads recipe versions up to "
                          f"{VERSION}: upgrade optkit to run it")
    current = {k: v for k, v in data.items() if k != "version"}
    try:
        for step in range(version, VERSION):
            current = MIGRATIONS[step](current)
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from e
    if version == VERSION:
        return current, None
    note = f"{source} is a version {version} recipe; it was migrated to version {VERSION} (save it again to keep it)"
    return current, note
