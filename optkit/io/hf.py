"""Hugging Face folders: a ``save_pretrained`` directory in (``hf:DIR``, or any folder holding ``config.json``).

The model class comes from the config's ``architectures`` (a causal LM, a
sequence or image classifier, a base model), always one of ``transformers``'
own classes: no code from the folder runs. Weights are read from
``model.safetensors`` or the shards a ``model.safetensors.index.json`` lists,
never from a pickle unless the user trusts the folder. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import ModelLoadError, UntrustedPickleError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["HF_PREFIX", "build_from_config", "hf_folder", "read_weights"]

HF_PREFIX = "hf:"
CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def hf_folder(spec: str) -> Path | None:
    """The folder a spec names when it is ``hf:DIR`` or a directory holding ``config.json``, else ``None``.

    Raises:
        ModelLoadError: for ``hf:DIR`` whose folder or ``config.json`` is missing.
    """
    text = str(spec)
    folder = Path(text[len(HF_PREFIX):]) if text.startswith(HF_PREFIX) else Path(text)
    if not text.startswith(HF_PREFIX):
        return folder if folder.is_dir() and (folder / CONFIG).is_file() else None
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder (hf:DIR names a folder written by save_pretrained)")
    if not (folder / CONFIG).is_file():
        raise ModelLoadError(f"{folder} has no config.json; hf:DIR needs a folder written by save_pretrained")
    return folder


def build_from_config(folder: str | os.PathLike) -> nn.Module:
    """The ``transformers`` model the folder's config describes, with fresh (random) weights.

    Raises:
        ModelLoadError: for a missing ``transformers``, an unreadable config, or an
            architecture that is not one of ``transformers``' classes.
    """
    try:
        import transformers
    except ImportError as e:
        raise ModelLoadError("a Hugging Face folder needs transformers: pip install transformers") from e
    folder = Path(folder)
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{folder / CONFIG} is not a config transformers can read ({_first_line(e)})") from e
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else transformers.AutoModel
    if cls is None:
        raise ModelLoadError(f"{folder / CONFIG} names architecture {names[0]!r}, which is not a transformers class "
                             "(optkit never runs a folder's own code)")
    try:
        return cls._from_config(config) if cls is transformers.AutoModel else cls(config)
    except Exception as e:
        raise ModelLoadError(f"cannot build {cls.__name__} from {folder / CONFIG} ({_first_line(e)})") from e


def read_weights(folder: str | os.PathLike, *, trust: bool = False) -> dict[str, torch.Tensor] | None:
    """The folder's weights as one state_dict, or ``None`` when it has no weight file at all.

    Raises:
        UntrustedPickleError: for weights stored only as a pickle, without ``trust``.
        ModelLoadError: for a damaged file or an index naming a missing shard.
    """
    from optkit.io.weights import read_checkpoint, read_safetensors

    folder = Path(folder)
    if (folder / SAFETENSORS).is_file():
        return read_safetensors(folder / SAFETENSORS)
    if (folder / SAFETENSORS_INDEX).is_file():
        return _read_shards(folder, folder / SAFETENSORS_INDEX, read_safetensors)
    pickled = [folder / name for name in PICKLED if (folder / name).is_file()]
    if not pickled:
        return None
    if not trust:
        raise UntrustedPickleError(f"{folder} stores its weights only as a pickle ({pickled[0].name}); "
                                   "save them with save_pretrained(safe_serialization=True), or pass --trust "
                                   "if you trust where the folder came from")
    if pickled[0].name.endswith(".json"):
        return _read_shards(folder, pickled[0], lambda path: read_checkpoint(path, trust=True))
    return read_checkpoint(pickled[0], trust=True)


def _read_shards(folder: Path, index: Path, read) -> dict[str, Any]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{index} is not a weight index (a JSON object with a weight_map)") from e
    state: dict[str, Any] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise ModelLoadError(f"{index.name} names shard {shard}, which is not in {folder}")
        state.update(read(folder / shard))
    return state


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__
