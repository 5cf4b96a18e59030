"""Model specs: build or load the model a user names.

Accepted specs:

* ``torchvision:NAME``: any name from ``torchvision.models.list_models()``,
  with random weights (nothing is downloaded) and ``num_classes``;
* ``timm:NAME``: any name from ``timm.list_models()``, built with ``pretrained=False``;
* a ``state_dict`` file (``torch.save`` or ``.safetensors``) plus ``arch``
  (``torchvision:NAME``, ``timm:NAME`` or ``package.module:Class``);
* an optkit slimmed checkpoint (see :mod:`optkit.io.checkpoint`);
* a whole pickled ``nn.Module``, only with ``trust=True``.

Files are always read with ``torch.load(weights_only=True)`` (or as
safetensors) unless the user trusts them, so a pickle's code never runs by
accident. A model's kind (:mod:`optkit.kinds`) is inferred from its structure,
or named with ``kind=`` (``--kind``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optkit.core.errors import ModelLoadError
from optkit.io import confirmed
from optkit.io.architectures import ArchSpec, arch_spec, torchvision_names
from optkit.io.weights import describe_mismatch, mark_random_weights, read_checkpoint, read_safetensors, short_error
from optkit.kinds.image import input_channels

__all__ = ["BUILDER_PREFIXES", "ArchSpec", "LoadedModel", "arch_spec", "describe_mismatch", "infer_input_shape",
           "input_channels", "load", "load_model", "random_weights_allowed", "read_checkpoint", "read_safetensors",
           "requested_kind", "torchvision_names"]

#: Spec prefixes that build an architecture by name (no file needed).
BUILDER_PREFIXES = ("torchvision:", "timm:")
_requested_kind: contextvars.ContextVar[str | None] = contextvars.ContextVar("optkit_requested_kind", default=None)
_random_weights: contextvars.ContextVar[bool] = contextvars.ContextVar("optkit_random_weights", default=False)

@dataclass
class LoadedModel:
    """A model with how it was obtained.

    Attributes:
        model: the module, on CPU.
        arch: how to rebuild its architecture, or ``None`` for a whole pickled module.
        source: the spec or path it came from.
        recorded_input_shape: the input shape an optkit ``model.pt`` records in its recipe, if any.
        notes: what the user should know about how it was loaded (e.g. random weights).
    """

    model: nn.Module
    arch: ArchSpec | None
    source: str
    recorded_input_shape: tuple[int, ...] | None = None
    notes: list[str] = field(default_factory=list)


def load(spec: str | os.PathLike, *, arch: str | None = None, num_classes: int | None = None,
         trust: bool = False, kind: str | None = None, random_weights: bool | None = None) -> LoadedModel:
    """Load a model from a spec, keeping track of its architecture.

    Args:
        spec: ``torchvision:NAME``, ``timm:NAME`` or a path to a checkpoint.
        arch: architecture for a ``state_dict`` file.
        num_classes: classifier size when building an architecture.
        trust: allow full unpickling (a whole pickled module).
        kind: the model's kind (see :mod:`optkit.kinds`); by default the one
            :func:`requested_kind` set, else inferred from the model.
        random_weights: build a Hugging Face folder that holds a config and no weights with random
            weights instead of refusing it (by default as :func:`random_weights_allowed` set, else no).

    Returns:
        the model and how to rebuild it.

    Raises:
        ModelLoadError: with what was wrong and how to fix it.
        OptkitError: for an unknown kind name.
    """
    from optkit.kinds import set_kind

    allowed = _random_weights.get() if random_weights is None else random_weights
    loaded = _load(spec, arch=arch, num_classes=num_classes, trust=trust, random_weights=allowed)
    named = kind if kind is not None else _requested_kind.get()
    if named is not None:
        set_kind(loaded.model, named)
    return loaded


@contextlib.contextmanager
def requested_kind(kind: str | None) -> Iterator[None]:
    """While active, every :func:`load` without ``kind=`` names its model's kind ``kind`` (``--kind``)."""
    token = _requested_kind.set(kind)
    try:
        yield
    finally:
        _requested_kind.reset(token)


@contextlib.contextmanager
def random_weights_allowed(allowed: bool) -> Iterator[None]:
    """While active, every :func:`load` without ``random_weights=`` builds a folder without weights with random
    weights when ``allowed`` (``--random-weights``), and refuses it otherwise."""
    token = _random_weights.set(allowed)
    try:
        yield
    finally:
        _random_weights.reset(token)


def _load(spec: str | os.PathLike, *, arch: str | None, num_classes: int | None, trust: bool,
          random_weights: bool) -> LoadedModel:
    from optkit.io import hf

    text = os.fspath(spec)
    folder = hf.hf_folder(text)
    if folder is not None:
        if arch is not None:
            raise ModelLoadError(f"--arch is only for state_dict files; {text} holds config.json, which names the "
                                 "architecture")
        return _load_hf_folder(folder, trust=trust, random_weights=random_weights)
    if text.startswith(BUILDER_PREFIXES) and not Path(text).exists():
        if arch is not None:
            raise ModelLoadError(f"--arch is only for state_dict files; {text} already names the architecture")
        architecture = arch_spec(text, num_classes)
        model = mark_random_weights(architecture.build(), f"{text} has random weights (nothing is downloaded)")
        return LoadedModel(model, architecture, text)

    obj = read_checkpoint(text, trust=trust)
    from optkit.io import checkpoint

    if checkpoint.is_slimmed(obj):
        model, architecture = checkpoint.rebuild(obj, trust=trust, confirmed_arch=arch or confirmed.confirmed_spec(text))
        return LoadedModel(model, architecture, text, checkpoint.recorded_input_shape(obj))
    if isinstance(obj, nn.Module):
        return LoadedModel(obj.cpu(), None, text)
    state_dict = _find_state_dict(obj)
    if state_dict is None:
        raise ModelLoadError(f"{text}: not a model checkpoint (found {type(obj).__name__}, expected a state_dict or an optkit model.pt)")
    if arch is None:
        raise ModelLoadError(f"{text} holds only weights (a state_dict); name the architecture with --arch "
                             "torchvision:NAME, --arch timm:NAME or --arch package.module:Class")
    architecture = arch_spec(arch, num_classes)
    model = architecture.build()
    mismatch = describe_mismatch(model.state_dict(), state_dict)
    if mismatch:
        raise ModelLoadError(f"{text} does not match --arch {arch}: {mismatch}; check --arch and --num-classes")
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise ModelLoadError(f"{text} does not load into --arch {arch} ({short_error(e)}); "
                             "check --arch and --num-classes") from e
    return LoadedModel(model, architecture, text)


def _load_hf_folder(folder: Path, *, trust: bool, random_weights: bool) -> LoadedModel:
    from optkit.io import hf

    model, notes = hf.load_folder(folder, trust=trust, random_weights=random_weights)
    return LoadedModel(model, ArchSpec(f"{hf.HF_PREFIX}{folder}"), str(folder), notes=notes)


def load_model(spec: str | os.PathLike, *, arch: str | None = None, num_classes: int | None = None,
               trust: bool = False) -> nn.Module:
    """Load a model from a spec; see :func:`load` for the arguments and errors."""
    return load(spec, arch=arch, num_classes=num_classes, trust=trust).model


def _find_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return obj
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if key in obj:
                return _find_state_dict(obj[key])
    return None


def infer_input_shape(loaded: LoadedModel) -> tuple[int, ...]:
    """The input shape to use when none is given.

    The shape an optkit ``model.pt`` records, else the default of the model's
    kind (:meth:`optkit.kinds.ModelKind.default_shape`: for an image classifier,
    one image of the size and channels the model states, else of the first
    convolution's input channels, so a grayscale model gets 1, at 224×224;
    ``1,128`` token ids for a language model, fewer when it has fewer positions).
    """
    from optkit.kinds import kind_of

    if loaded.recorded_input_shape is not None:
        return loaded.recorded_input_shape
    return kind_of(loaded.model).default_shape(loaded.model)
