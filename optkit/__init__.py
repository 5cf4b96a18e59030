"""optkit: make trained PyTorch models smaller and faster, and report honestly what changed.

The public API is re-exported here lazily, so ``import optkit`` (and the CLI's
``--help``) stays fast and does not import torch until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "OptkitError": "optkit.errors",
    "ModelLoadError": "optkit.errors",
    "UntrustedPickleError": "optkit.errors",
    "PassError": "optkit.errors",
    "RecipeError": "optkit.errors",
    "ExportError": "optkit.errors",
    "DataError": "optkit.errors",
    "TrainingError": "optkit.errors",
    "Pass": "optkit.passes.base",
    "get_pass": "optkit.passes._registry",
    "list_passes": "optkit.passes._registry",
    "L1Unstructured": "optkit.passes.prune",
    "StructuredPrune": "optkit.passes.prune",
    "FineTune": "optkit.passes.finetune",
    "ToDevice": "optkit.passes.device",
    "ChannelsLast": "optkit.passes.device",
    "Autocast": "optkit.passes.precision",
    "load_dataset": "optkit.data",
    "dataset_info": "optkit.data",
    "make_loader": "optkit.data",
    "Pipeline": "optkit.pipeline",
    "load_model": "optkit.models",
    "save_checkpoint": "optkit.checkpoint",
    "export_onnx": "optkit.export",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'optkit' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = getattr(module, "save" if name == "save_checkpoint" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
