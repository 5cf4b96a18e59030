"""The slimmed checkpoint: a pruned model that reloads with ``weights_only=True``.

A pruned model's layer shapes differ from its class defaults, so a plain
``state_dict`` does not load into a freshly built architecture. The slimmed
checkpoint records, next to the weights, how the module tree differs from the
architecture built from scratch:

* plain attributes that changed (``out_channels``, ``groups``, ``num_heads``...);
* modules added or replaced by passes (a BatchNorm inserted after a conv, an
  ``Identity`` left by folding), by class name, rebuilt only from classes in
  ``torch.nn``, ``torchvision`` and ``optkit`` (or the architecture's own module);
* tensor shapes come from the state_dict itself.

Everything in the file is tensors and plain Python values, so
``torch.load(path, weights_only=True)`` reads it and no code can run from it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from optkit import __version__
from optkit.core.files import atomic_path
from optkit.core.errors import ModelLoadError
from optkit.io import hf
from optkit.io.architectures import ArchSpec, import_module_class

FORMAT = "optkit.slimmed"
VERSION = 1
_SAFE_MODULE_PREFIXES = ("torch.nn.", "torchvision.", "optkit.")
_PLAIN = (bool, int, float, str, type(None))
# Bookkeeping attributes every nn.Module has; they are not architecture.
_SKIPPED_ATTRIBUTES = {"training", "_is_full_backward_hook", "call_super_init", "dump_patches"}


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside optkit wrappers (e.g. the autocast wrap), which checkpoints and export see through."""
    while hasattr(model, "optkit_unwrap"):
        model = model.optkit_unwrap()
    return model


def is_slimmed(obj: Any) -> bool:
    """Whether ``obj`` (a loaded file) is an optkit slimmed checkpoint."""
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def save(model: nn.Module, path: str | os.PathLike, arch: ArchSpec | None, *, extra: dict[str, Any] | None = None) -> None:
    """Atomically write ``model`` as a slimmed checkpoint.

    Args:
        model: the (possibly pruned or wrapped) model; wrappers are removed.
        path: destination file.
        arch: how the architecture was built. ``None`` (a model that came from
            a whole pickle) saves the whole module, which then needs trust to load.
        extra: plain values stored alongside (e.g. the recipe that produced it).
    """
    from optkit.kinds.base import KIND_ATTRIBUTE

    model = unwrap(model)
    if arch is not None and hf.is_hf_spec(arch.spec) and getattr(model, "config", None) is not None:
        # A pruned transformer's widths and depth live in its config: record the config it has now.
        arch = ArchSpec(arch.spec, {**arch.kwargs, "config": model.config.to_dict()})
    if arch is None:
        payload: Any = model
    else:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "optkit_version": __version__,
            "arch": arch.to_dict(),
            "kind": model.__dict__.get(KIND_ATTRIBUTE),
            # A transformer's head counts and widths also live in its config, which module attributes do not hold.
            "config": model.config.to_dict() if callable(getattr(getattr(model, "config", None), "to_dict", None))
            else None,
            "structure": structure_diff(arch.build(), model),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "extra": extra or {},
        }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def recorded_input_shape(checkpoint: dict[str, Any]) -> tuple[int, ...] | None:
    """The ``input_shape`` of the recipe a slimmed checkpoint records, or ``None`` when it records none."""
    import tomllib

    from optkit.core.settings import check_input_shape

    recipe = (checkpoint.get("extra") or {}).get("recipe")
    try:
        return check_input_shape(tomllib.loads(recipe).get("input_shape")) if isinstance(recipe, str) else None
    except (tomllib.TOMLDecodeError, ValueError):
        return None


def rebuild(checkpoint: dict[str, Any], *, trust: bool = False,
            confirmed_arch: str | None = None) -> tuple[nn.Module, ArchSpec]:
    """Build the model a slimmed checkpoint describes and load its weights.

    Args:
        checkpoint: the loaded file.
        trust: allow any class and any architecture module.
        confirmed_arch: the architecture the user named (``--arch``); it confirms a
            recorded ``package.module:Class`` whose module is not yet imported.

    Raises:
        ModelLoadError: for a newer format, an architecture module or class
            outside the allowed ones, a malformed structure, or weights that do not fit.
    """
    if checkpoint.get("version", 0) > VERSION:
        raise ModelLoadError(f"checkpoint format {checkpoint.get('version')} is newer than this optkit understands; upgrade optkit")
    try:
        arch = ArchSpec(checkpoint["arch"]["spec"], dict(checkpoint["arch"].get("kwargs", {})))
        _check_arch_module(arch.spec, confirmed=confirmed_arch, trust=trust)
        model = arch.build()
        allowed = _SAFE_MODULE_PREFIXES + (arch.spec.split(":")[0] + ".",)
        for path, entry in checkpoint["structure"].items():
            _apply_entry(model, path, entry, allowed, trust)
        if checkpoint.get("config") and callable(getattr(getattr(model, "config", None), "update", None)):
            model.config.update(checkpoint["config"])
        state_dict = checkpoint["state_dict"]
        _resize_tensors(model, state_dict)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ModelLoadError(f"malformed optkit checkpoint ({type(e).__name__}: {e}); save the model again") from e
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise ModelLoadError(f"slimmed checkpoint weights do not fit the rebuilt model: {str(e).splitlines()[0]}") from e
    if checkpoint.get("kind") is not None:
        from optkit.kinds import set_kind

        set_kind(model, checkpoint["kind"])
    return model, arch


def _check_arch_module(spec: str, *, confirmed: str | None, trust: bool) -> None:
    # Importing a module runs its top-level code, so a file may only name a
    # module that is part of optkit's own stack or already imported, unless
    # the user names the same architecture or trusts the file.
    module_name = spec.partition(":")[0]
    if trust or confirmed == spec or module_name in sys.modules:
        return
    if module_name.split(".")[0] in ("torchvision", "timm", "optkit"):
        return
    raise ModelLoadError(f"checkpoint's architecture {spec} would import module {module_name} and run its code; "
                         f"if you expect that architecture pass --arch {spec}, or --trust if you trust the file")


def structure_diff(reference: nn.Module, model: nn.Module) -> dict[str, dict[str, Any]]:
    """How ``model``'s module tree differs from ``reference`` (same architecture, unpruned).

    Returns:
        ``{module path: {"type": qualified class name, "new": bool, "attrs": {...}}}``
        in pre-order, listing modules that are new or whose type or plain
        attributes changed.
    """
    ref_modules = dict(reference.named_modules())
    diff: dict[str, dict[str, Any]] = {}
    for path, module in model.named_modules():
        ref = ref_modules.get(path)
        is_new = ref is None or type(ref) is not type(module)
        attrs = _plain_attributes(module)
        if not is_new:
            ref_attrs = _plain_attributes(ref)
            attrs = {k: v for k, v in attrs.items() if ref_attrs.get(k, _MISSING) != v}
        if is_new:
            diff[path] = {"type": _qualified_name(type(module)), "new": True, "attrs": attrs, **_slots(module)}
        elif attrs:
            diff[path] = {"type": _qualified_name(type(module)), "new": False, "attrs": attrs}
    return diff


def _slots(module: nn.Module) -> dict[str, Any]:
    # What a module built without __init__ must know beyond the state_dict: which
    # names are parameters (not buffers), slots registered as None (e.g. bias=False),
    # and non-persistent buffers.
    return {
        "parameters": list(module._parameters),
        "buffers": [k for k in module._buffers if k not in module._non_persistent_buffers_set],
        "non_persistent_buffers": {k: module._buffers[k].detach().cpu() for k in module._non_persistent_buffers_set
                                   if module._buffers.get(k) is not None},
    }


_MISSING = object()


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in _SKIPPED_ATTRIBUTES and _is_plain(v)}


def _is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_class(qualified: str, allowed: tuple[str, ...], trust: bool) -> type:
    if not trust and not qualified.startswith(allowed):
        raise ModelLoadError(f"checkpoint asks for class {qualified}, outside torch.nn/torchvision/optkit; pass --trust to allow it")
    module_name, _, class_name = qualified.rpartition(".")
    return import_module_class(module_name, class_name)


def _apply_entry(model: nn.Module, path: str, entry: dict[str, Any], allowed: tuple[str, ...], trust: bool) -> None:
    if entry["new"]:
        cls = _import_class(entry["type"], allowed, trust)
        # Built without __init__: its constructor arguments are not recorded,
        # but its plain attributes, children and tensors are, and are restored next.
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._parameters.update(dict.fromkeys(entry["parameters"]))
        module._buffers.update(dict.fromkeys(entry["buffers"]))
        for name, tensor in entry["non_persistent_buffers"].items():
            module.register_buffer(name, tensor, persistent=False)
        _set_module(model, path, module)
    else:
        module = model.get_submodule(path)
    for key, value in entry["attrs"].items():
        setattr(module, key, value)


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ModelLoadError("slimmed checkpoint replaces the root module, which cannot be rebuilt")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    parent._modules[name] = module


def _resize_tensors(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    for key, value in state_dict.items():
        owner_path, _, name = key.rpartition(".")
        try:
            owner = model.get_submodule(owner_path) if owner_path else model
        except AttributeError as e:
            raise ModelLoadError(f"slimmed checkpoint has weights for {key}, which the rebuilt model lacks") from e
        if name in owner._parameters:
            current = owner._parameters[name]
            # A weight keeps the dtype it was saved in (a bf16 checkpoint reloads as bf16, not upcast).
            if current is None or current.shape != value.shape or current.dtype != value.dtype:
                owner._parameters[name] = nn.Parameter(torch.empty_like(value), requires_grad=value.is_floating_point())
        elif name in owner._buffers or name not in vars(owner):
            current = owner._buffers.get(name)
            if current is None or current.shape != value.shape:
                owner._buffers[name] = torch.empty_like(value)
