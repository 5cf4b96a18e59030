"""The pass registry: unique pass name -> pass class, open to passes from anywhere.

Three sources, read lazily so that ``optkit passes`` and ``--help`` import neither torch nor the passes:

* **built-in passes**: every class decorated with ``@register_pass`` in a module
  under ``optkit/passes/``, found by reading the source (adding a pass needs
  only its module);
* **installed packages**: entry points in the ``optkit.passes`` group, each
  ``name = "package.module:Class"`` (see ``docs/architecture.md``);
* **your own classes**: ``@register_pass`` on a :class:`~optkit.core.contract.Pass`
  subclass registers it when its module is imported.

The Python API, the recipe loader, the CLI and the tests all read this registry.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from optkit.core.contract import Pass

ENTRY_POINT_GROUP = "optkit.passes"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PASSES_DIR = Path(__file__).resolve().parent.parent / "passes"
_registered: dict[str, type] = {}
P = TypeVar("P", bound=type)


def register_pass(cls: P) -> P:
    """Class decorator: register a :class:`~optkit.core.contract.Pass` subclass under its ``name``.

    Its ``Args:`` docstring section is written from the declared settings.

    Raises:
        TypeError: if ``cls`` is not a frozen dataclass subclassing ``Pass``.
        ValueError: if the name is not snake_case or another class has it.
    """
    from optkit.core.contract import Pass
    from optkit.core.settings import args_section

    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise TypeError(f"@register_pass needs a subclass of optkit.Pass, got {cls!r}")
    if "__dataclass_params__" not in cls.__dict__ or not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a @dataclass(frozen=True) so its settings cannot change after validation")
    if not isinstance(cls.name, str) or not _NAME.match(cls.name):
        raise ValueError(f"{cls.__name__}.name must be a snake_case pass name such as 'my_prune', got {cls.name!r}")
    target = _target(cls)
    known = _registered.get(cls.name)
    source = _sources().get(cls.name)
    if (known is not None and _target(known) != target) or (source is not None and source != target):
        raise ValueError(f"pass name {cls.name!r} is already registered by {source or _target(known)}; "
                         "choose another name")
    _registered[cls.name] = cls
    section = args_section(cls)
    if section and "Args:" not in (cls.__doc__ or ""):
        cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n{section}\n"
    return cls


def list_passes(pattern: str = "*") -> list[str]:
    """Registered pass names matching an fnmatch ``pattern``, sorted."""
    names = set(_sources()) | set(_registered)
    return sorted(name for name in names if fnmatch.fnmatchcase(name, pattern))


def builtin_passes() -> list[str]:
    """The names of optkit's own passes (those the CLI gives friendly flags)."""
    return sorted(_builtin_sources())


def get_pass(name: str) -> type[Pass]:
    """The pass class registered under ``name`` (importing its module if needed).

    Raises:
        KeyError: if no pass has that name; the message lists the valid names.
        RuntimeError: if a registered module does not define the pass it promises.
    """
    if name in _registered:
        return _registered[name]
    target = _sources().get(name)
    if target is None:
        raise KeyError(f"unknown pass {name!r}; valid passes: {', '.join(list_passes())}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if cls is None or getattr(cls, "name", None) != name:
        raise RuntimeError(f"pass {name!r} should be {target}, but that class is missing or named differently")
    _registered.setdefault(name, cls)
    return cls


def builtin_pass_targets() -> dict[str, str]:
    """Each built-in pass name mapped to ``module:Class``, read from the source without importing it."""
    return dict(_builtin_sources())


def describe_passes(pattern: str = "*") -> dict[str, str]:
    """Map each registered pass name to the first line of its class docstring (read without importing it)."""
    sources = _sources()
    out = {}
    for name in list_passes(pattern):
        if name in sources:
            out[name] = _first_docstring_line(sources[name])
        else:
            doc = (_registered[name].__doc__ or "").strip()
            out[name] = doc.splitlines()[0] if doc else ""
    return out


def _target(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _sources() -> dict[str, str]:
    sources = dict(_entry_point_sources())
    for name, target in _builtin_sources().items():
        if name in sources and sources[name] != target:
            raise RuntimeError(f"the installed entry point {sources[name]} reuses the built-in pass name {name!r}; "
                               f"rename it in that package's '{ENTRY_POINT_GROUP}' entry points")
        sources[name] = target
    return sources


@lru_cache(maxsize=1)
def _entry_point_sources() -> dict[str, str]:
    return {ep.name: ep.value.replace(" ", "") for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


@lru_cache(maxsize=1)
def _builtin_sources() -> dict[str, str]:
    return registered_in_source(sorted(_PASSES_DIR.rglob("*.py")), "register_pass", "pass")


def registered_in_source(paths: list[Path], decorator: str, what: str) -> dict[str, str]:
    """``name -> "optkit.module:Class"`` for every class in ``paths`` (files of the optkit package, read as text,
    not imported) decorated with ``decorator``, by the literal ``name = "..."`` of its body.

    Raises:
        RuntimeError: two such classes with one name, or one without a literal name.
    """
    package_dir = Path(__file__).resolve().parent.parent
    found: dict[str, str] = {}
    for path in paths:
        module = "optkit." + ".".join(path.resolve().relative_to(package_dir).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
            if isinstance(node, ast.ClassDef) and any(_is_decorator(d, decorator) for d in node.decorator_list):
                name = _class_name_attribute(node, what)
                if name in found:
                    raise RuntimeError(f"two built-in {what}s are named {name!r}: {found[name]} and {module}:{node.name}")
                found[name] = f"{module}:{node.name}"
    return found


def _is_decorator(decorator: ast.expr, name: str) -> bool:
    return (isinstance(decorator, ast.Name) and decorator.id == name) or (
        isinstance(decorator, ast.Attribute) and decorator.attr == name)


def _class_name_attribute(node: ast.ClassDef, what: str) -> str:
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
        value = getattr(item, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "name" for t in targets) and isinstance(value, ast.Constant):
            return str(value.value)
    raise RuntimeError(f"registered {what} class {node.name} has no literal name = '...' attribute")


@lru_cache(maxsize=None)
def _module_tree(module_name: str) -> ast.Module:
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"registered pass module {module_name!r} not found")
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=spec.origin)


def _first_docstring_line(target: str) -> str:
    module_name, class_name = target.split(":")
    for node in _module_tree(module_name).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            doc = ast.get_docstring(node) or ""
            return doc.strip().splitlines()[0] if doc.strip() else ""
    raise RuntimeError(f"class {class_name} not found in {module_name}")
