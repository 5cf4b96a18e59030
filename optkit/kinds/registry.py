"""The kind registry: built-in kinds, ``@register_kind`` for your own, and the ``optkit.kinds`` entry points.

Built-in kinds are listed here by ``module:Class`` and imported on first use;
an installed package adds one with an entry point (``name = "package.module:Class"``,
the name being the kind's ``name``); in a script, ``@register_kind`` on a
:class:`~optkit.kinds.base.ModelKind` subclass does the same.
"""

from __future__ import annotations

import fnmatch
import importlib
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, TypeVar

from optkit.core.errors import OptkitError
from optkit.kinds.base import KIND_ATTRIBUTE, ModelKind

if TYPE_CHECKING:
    from torch import nn

__all__ = ["BUILTIN_KINDS", "ENTRY_POINT_GROUP", "get_kind", "kind_of", "list_kinds", "register_kind", "set_kind"]

ENTRY_POINT_GROUP = "optkit.kinds"
BUILTIN_KINDS = {
    "detection": "optkit.kinds.detection:Detection",
    "segmentation": "optkit.kinds.segmentation:Segmentation",
    "tokens": "optkit.kinds.tokens:TokenModel",
    "image_classifier": "optkit.kinds.image:ImageClassifier",
}
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


@lru_cache(maxsize=1)
def _load_sources() -> None:
    for target in BUILTIN_KINDS.values():
        module, _, name = target.partition(":")
        register_kind(getattr(importlib.import_module(module), name))
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
