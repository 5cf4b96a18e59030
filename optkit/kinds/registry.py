"""The kind registry: ``@register_kind``, and the ``optkit.kinds`` entry points.

Every kind registers the same way: ``@register_kind`` on a
:class:`~optkit.kinds.base.ModelKind` subclass registers it when its module is
imported. Kinds come from three sources, read on first use:

* **built-in kinds**: every class decorated with ``@register_kind`` in a module
  of ``optkit/kinds/``, found by reading the source (adding a kind needs only its module);
* **installed packages**: entry points in the ``optkit.kinds`` group, each
  ``name = "package.module:Class"`` (the name being the kind's ``name``);
* **your own classes**: ``@register_kind`` in a script or test.
"""

from __future__ import annotations

import fnmatch
import importlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from optkit.core.errors import OptkitError
from optkit.core.registry import registered_in_source
from optkit.kinds.base import KIND_ATTRIBUTE, ModelKind

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ENTRY_POINT_GROUP", "builtin_kinds", "get_kind", "kind_of", "list_kinds", "register_kind", "set_kind"]

ENTRY_POINT_GROUP = "optkit.kinds"
_KINDS_DIR = Path(__file__).resolve().parent
K = TypeVar("K", bound=type)

_registered: dict[str, type[ModelKind]] = {}


def register_kind(cls: K) -> K:
    """Class decorator: register a :class:`ModelKind` subclass under its ``name``.

    Raises:
        TypeError: if ``cls`` is not a ``ModelKind`` subclass.
        ValueError: if the name is empty or another class has it.
    """
    if not (isinstance(cls, type) and issubclass(cls, ModelKind)):
        raise TypeError(f"@register_kind needs a subclass of ModelKind, got {cls!r}")
    if not cls.name or not cls.name.replace("_", "").isalnum() or not cls.name.islower():
        raise ValueError(f"{cls.__name__}.name must be a snake_case kind name such as 'my_kind', got {cls.name!r}")
    known = _registered.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"kind name {cls.name!r} is already registered by {known.__module__}.{known.__qualname__}")
    _registered[cls.name] = cls
    _instances.cache_clear()
    return cls


def builtin_kinds() -> list[str]:
    """The names of optkit's own kinds, sorted, read from the source without importing it."""
    return sorted(_builtin_sources())


@lru_cache(maxsize=1)
def _builtin_sources() -> dict[str, str]:
    """Each built-in kind's name mapped to its module: the ``@register_kind`` classes of ``optkit/kinds/*.py``."""
    found = registered_in_source(sorted(_KINDS_DIR.glob("*.py")), "register_kind", "kind")
    return {name: target.partition(":")[0] for name, target in found.items()}


@lru_cache(maxsize=1)
def _load_sources() -> None:
    for name, module in _builtin_sources().items():
        importlib.import_module(module)  # its @register_kind registers the kind
        if name not in _registered:
            raise RuntimeError(f"{module} did not register its kind {name!r}")
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = entry.load()
        if getattr(cls, "name", None) != entry.name:
            raise OptkitError(f"entry point {entry.name!r} in group {ENTRY_POINT_GROUP} loads {cls!r}, whose name is not "
                              f"{entry.name!r}; the entry point's name must be the kind's name")
        register_kind(cls)


@lru_cache(maxsize=1)
def _instances() -> tuple[ModelKind, ...]:
    _load_sources()
    return tuple(cls() for cls in sorted(_registered.values(), key=lambda c: (c.priority, c.name)))


def list_kinds(pattern: str = "*") -> list[str]:
    """Registered kind names matching an fnmatch ``pattern``, in inference order."""
    return [kind.name for kind in _instances() if fnmatch.fnmatchcase(kind.name, pattern)]


def get_kind(name: str) -> ModelKind:
    """The registered kind called ``name``.

    Raises:
        OptkitError: naming the registered kinds when there is none by that name.
    """
    for kind in _instances():
        if kind.name == name:
            return kind
    raise OptkitError(f"unknown model kind {name!r}; choose from {', '.join(list_kinds())}")


def set_kind(model: nn.Module, name: str | None) -> nn.Module:
    """Name ``model``'s kind (``None`` clears it, so it is inferred again); returns the model.

    Raises:
        OptkitError: for an unknown kind name.
    """
    if name is None:
        model.__dict__.pop(KIND_ATTRIBUTE, None)
        return model
    get_kind(name)
    model.__dict__[KIND_ATTRIBUTE] = name
    return model


def kind_of(model: nn.Module) -> ModelKind:
    """The kind named for ``model`` (:func:`set_kind`), else the first registered kind that matches it."""
    named = model.__dict__.get(KIND_ATTRIBUTE)
    if named is not None:
        return get_kind(named)
    for kind in _instances():
        if kind.matches(model):
            return kind
    return get_kind("image_classifier")
