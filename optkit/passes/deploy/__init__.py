"""Deployments of an exported model: OpenVINO IR at fp32, bf16 or INT8, and the fastest verified one chosen by timing.

Names are re-exported lazily, so reading the settings (the CLI does) imports neither numpy nor OpenVINO.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CANDIDATES": "optkit.passes.deploy.settings",
    "CheckSettings": "optkit.passes.deploy.settings",
    "DeploySettings": "optkit.passes.deploy.settings",
    "OpenVinoSettings": "optkit.passes.deploy.settings",
    "Deploy": "optkit.passes.deploy.passes",
    "OpenVino": "optkit.passes.deploy.passes",
    "OpenVinoResult": "optkit.passes.deploy.convert",
    "openvino_ir": "optkit.passes.deploy.convert",
    "DeployResult": "optkit.passes.deploy.choose",
    "choose_deployment": "optkit.passes.deploy.choose",
    "pick": "optkit.passes.deploy.choose",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'optkit.passes.deploy' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
