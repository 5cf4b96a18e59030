"""optkit: make trained PyTorch models smaller and faster, and report honestly what changed.

The public API is re-exported here lazily, so ``import optkit`` (and the CLI's
``--help``) stays fast and does not import torch until a name is used. Every
built-in pass class is public (found through the pass registry), with the
names in ``_NAMES``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public names that are not passes, and the module each comes from.
_NAMES = {
    "OptkitError": "optkit.core.errors",
    "ModelLoadError": "optkit.core.errors",
    "UntrustedPickleError": "optkit.core.errors",
    "PassError": "optkit.core.errors",
    "RecipeError": "optkit.core.errors",
    "ExportError": "optkit.core.errors",
    "DataError": "optkit.core.errors",
    "TrainingError": "optkit.core.errors",
    "FormError": "optkit.core.errors",
    "Pass": "optkit.core.contract",
    "PassResult": "optkit.core.contract",
    "register_pass": "optkit.core.registry",
    "get_pass": "optkit.core.registry",
    "list_passes": "optkit.core.registry",
    "Pipeline": "optkit.core.pipeline",
    "RunContext": "optkit.core.context",
    "OnnxModel": "optkit.core.forms",
    "ModelKind": "optkit.kinds",
    "ModelInputs": "optkit.kinds",
    "register_kind": "optkit.kinds",
    "get_kind": "optkit.kinds",
    "kind_of": "optkit.kinds",
    "list_kinds": "optkit.kinds",
    "set_kind": "optkit.kinds",
    "load_dataset": "optkit.data",
    "dataset_info": "optkit.data",
    "make_loader": "optkit.data",
    "load_model": "optkit.io.models",
    "save_checkpoint": "optkit.io.checkpoint",
    "export_onnx": "optkit.export.onnx",
}
#: Names whose attribute in their module differs from the public name.
_RENAMED = {"save_checkpoint": "save"}


def _exports() -> dict[str, str]:
    """Every public name and its module: :data:`_NAMES` and each built-in pass class (from the registry)."""
    from optkit.core.registry import builtin_pass_targets

    exports = dict(_NAMES)
    for target in builtin_pass_targets().values():
        module, class_name = target.split(":")
        exports[class_name] = module
    return exports


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted(_exports()) + ["__version__"]
    exports = _exports()
    if name not in exports:
        raise AttributeError(f"module 'optkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(exports[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_exports()) + ["__version__"]
