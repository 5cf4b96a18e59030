"""The pass registry: unique pass name -> pass class.

The table below is the single source of truth read by the Python API, the
recipe loader, the CLI and the tests. Classes are imported only when asked
for, so listing passes (``optkit passes``) does not import torch; their one-line
descriptions are read from the class docstrings without importing the modules.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optkit.passes.base import Pass

_PASSES: dict[str, str] = {
    "finetune": "optkit.passes.finetune:FineTune",
    "l1_unstructured": "optkit.passes.prune:L1Unstructured",
    "structured_prune": "optkit.passes.prune:StructuredPrune",
    "insert_batchnorm": "optkit.passes.batchnorm:InsertBatchNorm",
    "fold_batchnorm": "optkit.passes.batchnorm:FoldBatchNorm",
    "recalibrate_batchnorm": "optkit.passes.batchnorm:RecalibrateBatchNorm",
    "to_device": "optkit.passes.device:ToDevice",
    "channels_last": "optkit.passes.device:ChannelsLast",
    "autocast": "optkit.passes.precision:Autocast",
}


def list_passes(pattern: str = "*") -> list[str]:
    """Registered pass names matching an fnmatch ``pattern``, sorted."""
    return sorted(name for name in _PASSES if fnmatch.fnmatchcase(name, pattern))


def get_pass(name: str) -> type[Pass]:
    """The pass class registered under ``name``.

    Raises:
        KeyError: if no pass has that name; the message lists the valid names.
    """
    if name not in _PASSES:
        raise KeyError(f"unknown pass {name!r}; valid passes: {', '.join(list_passes())}")
    module_name, class_name = _PASSES[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if cls.name != name:
        raise RuntimeError(f"registry entry {name!r} points to {cls.__name__} whose name is {cls.name!r}")
    return cls


def describe_passes(pattern: str = "*") -> dict[str, str]:
    """Map each registered pass name to the first line of its class docstring."""
    return {name: _first_docstring_line(_PASSES[name]) for name in list_passes(pattern)}


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
