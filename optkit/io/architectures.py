"""Architecture specs: how to build a model from scratch (``torchvision:NAME``, ``timm:NAME`` or ``package.module:Class``).

Building never downloads anything: every ``weights*`` argument of a torchvision builder is ``None``,
and timm models are created with ``pretrained=False``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from optkit.core.errors import ModelLoadError


@dataclass(frozen=True)
class ArchSpec:
    """How to build an architecture from scratch.

    Attributes:
        spec: ``torchvision:NAME``, ``timm:NAME``, ``hf:DIR`` (a ``save_pretrained`` folder's config)
            or ``package.module:Class``.
        kwargs: constructor keyword arguments (plain values only), e.g. ``num_classes``.
    """

    spec: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> nn.Module:
        """Construct the architecture with fresh (random) weights.

        Raises:
            ModelLoadError: if the name is unknown or the class cannot be built.
        """
        kind, _, name = self.spec.partition(":")
        if not name:
            raise ModelLoadError(f"architecture spec {self.spec!r} must look like torchvision:NAME, timm:NAME "
                                 "or package.module:Class")
        if kind == "torchvision":
            return _build_torchvision(name, self.kwargs)
        if kind == "timm":
            return _build_timm(name, self.kwargs)
        if kind == "hf":
            from optkit.io.hf import build_from_config

            return build_from_config(name, self.kwargs.get("config"))
        return _build_class(kind, name, self.kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "kwargs": dict(self.kwargs)}


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def arch_spec(spec: str, num_classes: int | None = None) -> ArchSpec:
    """An :class:`ArchSpec` for ``spec``, with ``num_classes`` when given."""
    return ArchSpec(spec, {} if num_classes is None else {"num_classes": int(num_classes)})


def _build_torchvision(name: str, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    names = torchvision.models.list_models()
    if name not in names:
        close = [n for n in names if n.startswith(name[:4])][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ModelLoadError(f"unknown torchvision model {name!r}{hint}; see torchvision.models.list_models()")
    extra = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
    # Detection and segmentation builders also take weights_backbone (and the like), which some
    # default to ImageNet weights: every weights* keyword is None, so nothing is ever downloaded.
    parameters = inspect.signature(torchvision.models.get_model_builder(name)).parameters
    no_weights = {p: None for p in parameters if p.startswith("weights")}
    try:
        return torchvision.models.get_model(name, **no_weights, **extra, **kwargs)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"cannot build torchvision:{name} with {kwargs}: {e}") from e


def _build_timm(name: str, kwargs: dict[str, Any]) -> nn.Module:
    try:
        import timm
    except ImportError as e:
        raise ModelLoadError("timm:NAME needs timm: pip install timm") from e
    if not timm.is_model(name):
        close = timm.list_models(f"{name[:4]}*")[:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ModelLoadError(f"unknown timm model {name!r}{hint}; see timm.list_models()")
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"cannot build timm:{name} with {kwargs}: {e}") from e


def import_module_class(module_name: str, class_name: str) -> type[nn.Module]:
    """Import ``module_name`` (which runs its code: callers decide whether that is allowed) and return its class.

    Raises:
        ModelLoadError: if it cannot be imported or is not an ``nn.Module`` class.
    """
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"cannot import {module_name}:{class_name} ({e}); is its package on PYTHONPATH?") from e
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelLoadError(f"{module_name}:{class_name} is not an nn.Module class")
    return cls


def _build_class(module_name: str, class_name: str, kwargs: dict[str, Any]) -> nn.Module:
    cls = import_module_class(module_name, class_name)
    parameters = inspect.signature(cls).parameters
    accepted = {k: v for k, v in kwargs.items() if k in parameters or any(
        p.kind is p.VAR_KEYWORD for p in parameters.values())}
    try:
        return cls(**accepted)
    except Exception as e:
        raise ModelLoadError(f"cannot build {module_name}:{class_name}({accepted}): {e}") from e
