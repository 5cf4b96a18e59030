"""TOML recipes: the one schema shared by recipe files and CLI flags.

A recipe is read strictly: an unknown top-level key, pass name or pass setting
is an error that lists the valid ones. Example::

    version = 2
    input_shape = [1, 3, 224, 224]

    [[pass]]
    name = "structured_prune"
    ratio = 0.3
    round_to = 8

A setting whose Python name ends in ``_`` (``global_``, a keyword) is written
without it (``global = true``). Every recipe written carries the format
``version``; older recipe files are migrated when read (see
:mod:`optkit.core.recipe_versions`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from typing import TYPE_CHECKING, Any

from optkit.core.errors import RecipeError
from optkit.core.recipe_versions import UNVERSIONED, VERSION, upgrade
from optkit.core.registry import get_pass, list_passes

if TYPE_CHECKING:
    from optkit.core.contract import Pass

TOP_LEVEL_KEYS = ("version", "input_shape", "device", "pass")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def parse(text: str, *, source: str = "recipe") -> dict[str, Any]:
    """Parse recipe TOML and validate it.

    A recipe without a ``version`` key is version 1 (the format before versions) and is migrated.

    Returns:
        ``{"input_shape": tuple | None, "device": str | None, "passes": [Pass, ...], "notes": [str, ...]}``; ``notes`` says when the recipe was migrated from an older version.

    Raises:
        RecipeError: for malformed TOML, a version newer than this optkit reads, unknown keys or passes,
            or invalid settings.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{source} is not valid TOML: {e}") from e
    return from_dict(data, source=source, default_version=UNVERSIONED)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a recipe file; see :func:`parse`.

    Raises:
        RecipeError: if the file is missing, unreadable or invalid.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"cannot read recipe {os.fspath(path)}: {e}") from e
    return parse(text, source=os.fspath(path))


def from_dict(data: dict[str, Any], *, source: str = "recipe", default_version: int = VERSION) -> dict[str, Any]:
    """Validate an already-parsed recipe mapping; see :func:`parse`.

    Args:
        data: the mapping (not changed).
        source: where it came from, for messages.
        default_version: the version of a mapping without a ``version`` key: the current one for
            mappings built in code (CLI flags), 1 for recipe files.
    """
    from optkit.core.settings import SHARED_SETTINGS

    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a table of keys, got {type(data).__name__}")
    data, note = upgrade(data, source, default=default_version)
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise RecipeError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(TOP_LEVEL_KEYS)}")
    entries = data.get("pass", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise RecipeError(f"{source}: passes must be [[pass]] tables")
    shared = {}
    for key, spec in SHARED_SETTINGS.items():
        try:
            shared[key] = spec.check(data.get(key))
        except ValueError as e:
            raise RecipeError(f"{source}: {e}") from e
    passes = [_build_pass(entry, index, source) for index, entry in enumerate(entries, start=1)]
    return {**shared, "passes": passes, "notes": [note] if note else []}


def setting_key(field_name: str) -> str:
    """The recipe key for a pass's dataclass field (``global_`` -> ``global``)."""
    return field_name.rstrip("_")


def _build_pass(entry: dict[str, Any], index: int, source: str) -> Pass:
    from optkit.core.contract import recipe_fields

    settings = dict(entry)
    name = settings.pop("name", None)
    if name is None:
        raise RecipeError(f"{source}: pass #{index} has no name; valid passes: {', '.join(list_passes())}")
    try:
        cls = get_pass(name)
    except KeyError as e:
        raise RecipeError(f"{source}: pass #{index}: {e.args[0]}") from e
    fields = recipe_fields(cls)
    run_options = sorted(setting_key(f.name) for f in dataclasses.fields(cls) if f.init and setting_key(f.name) not in fields)
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        extra = f" ({', '.join(k for k in unknown if k in run_options)} only at run time, not in recipes)" \
            if set(unknown) & set(run_options) else ""
        raise RecipeError(f"{source}: pass '{name}' has no recipe setting(s) {', '.join(unknown)}{extra}; "
                          f"valid: {', '.join(sorted(fields))}")
    kwargs = {fields[k].name: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{source}: pass '{name}': {e}") from e


def dumps(passes: list[Pass], *, input_shape: tuple[int, ...] | None = None, device: str | None = None) -> str:
    """Render passes and the shared settings as recipe TOML that :func:`parse` reads back.

    Raises:
        RecipeError: if a setting is not representable in TOML (e.g. a Python object).
    """
    lines = [f"version = {VERSION}"]
    if input_shape is not None:
        lines.append(f"input_shape = {_value(list(input_shape))}")
    if device is not None:
        lines.append(f"device = {_value(device)}")
    for p in passes:
        lines += ["", "[[pass]]", f"name = {_value(p.name)}"]
        for key, value in p.settings().items():
            try:
                lines.append(f"{_key(setting_key(key))} = {_value(value)}")
            except TypeError as e:
                raise RecipeError(f"pass '{p.name}' setting {key!r} cannot be written to a recipe: {e}") from e
    return "\n".join(lines).lstrip("\n") + "\n"


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _value(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(str(k))} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"{type(value).__name__} values are not supported")
