"""optkit: make trained PyTorch models smaller and faster, and report honestly what changed.

The public API is re-exported here lazily, so ``import optkit`` (and the CLI's
``--help``) stays fast and does not import torch until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "OptkitError": "optkit.core.errors",
    "ModelLoadError": "optkit.core.errors",
    "UntrustedPickleError": "optkit.core.errors",
    "PassError": "optkit.core.errors",
    "RecipeError": "optkit.core.errors",
    "ExportError": "optkit.core.errors",
    "DataError": "optkit.core.errors",
    "TrainingError": "optkit.core.errors",
    "Pass": "optkit.core.contract",
    "get_pass": "optkit.core.registry",
    "list_passes": "optkit.core.registry",
    "L1Unstructured": "optkit.passes.prune.passes",
    "StructuredPrune": "optkit.passes.prune.passes",
    "FineTune": "optkit.passes.finetune.passes",
    "ToDevice": "optkit.passes.device.passes",
    "ChannelsLast": "optkit.passes.device.passes",
    "Autocast": "optkit.passes.precision.passes",
    "load_dataset": "optkit.data",
    "dataset_info": "optkit.data",
    "make_loader": "optkit.data",
    "Pipeline": "optkit.core.pipeline",
    "load_model": "optkit.io.models",
    "save_checkpoint": "optkit.io.checkpoint",
    "export_onnx": "optkit.export.onnx",
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
