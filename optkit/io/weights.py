"""Reading weight files safely (``torch.save`` checkpoints, ``weights_only`` unless trusted; safetensors), and
saying in one line how a state_dict differs from the one a model expects."""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from optkit.core.errors import ModelLoadError, UntrustedPickleError

__all__ = ["TRUST_HINT", "ZIP_EXPANSION_SLACK", "describe_mismatch", "mark_random_weights", "random_weights",
           "read_checkpoint", "read_safetensors", "short_error"]

#: How much a zip checkpoint's members may expand beyond the file's own size.
#: ``torch.save`` stores members uncompressed, so a real checkpoint never
#: expands; a deflated archive could inflate a small file into gigabytes.
ZIP_EXPANSION_SLACK = 1 << 20

#: safetensors files start with the little-endian length of a JSON header that opens with ``{``.
SAFETENSORS_HEADER_OFFSET = 8

TRUST_HINT = (
    "it contains pickled Python objects, and unpickling can run arbitrary code; "
    "pass --trust (trust=True) only if you trust where the file came from"
)
#: Where a model built without weights (``torchvision:NAME``, ``timm:NAME``) keeps why its weights are random.
RANDOM_WEIGHTS_ATTRIBUTE = "_optkit_random_weights"


def mark_random_weights(model: torch.nn.Module, why: str) -> torch.nn.Module:
    """Record on ``model`` that its weights are random, and why (kept by copies and in-place passes); returns it."""
    model.__dict__[RANDOM_WEIGHTS_ATTRIBUTE] = why
    return model


def random_weights(model: torch.nn.Module) -> str | None:
    """Why ``model``'s weights are random (see :func:`mark_random_weights`), or ``None`` when they were loaded."""
    return model.__dict__.get(RANDOM_WEIGHTS_ATTRIBUTE)


def read_checkpoint(path: str | os.PathLike, *, trust: bool = False) -> Any:
    """Read a ``torch.save`` file, safely unless ``trust`` is given.

    Raises:
        ModelLoadError: for a missing, empty or unreadable file, or one that
            needs full unpickling without ``trust``.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file (give a checkpoint path or torchvision:NAME)")
    if p.is_dir():
        raise ModelLoadError(f"{p} is a directory; give the checkpoint file inside it")
    if not p.is_file():
        raise ModelLoadError(f"{p} is not a regular file (a pipe, socket or device); give a checkpoint file")
    if p.stat().st_size == 0:
        raise ModelLoadError(f"{p} is empty; it is not a PyTorch checkpoint")
    with open(p, "rb") as f:
        magic = f.read(2)
        f.seek(SAFETENSORS_HEADER_OFFSET)
        header_start = f.read(1)
    if header_start == b"{" and magic not in (b"PK",) and magic[:1] != b"\x80":
        return read_safetensors(p)
    # torch.save writes a zip archive ("PK"); older files are raw pickles (0x80 = protocol 2+).
    if magic != b"PK" and magic[:1] != b"\x80":
        raise ModelLoadError(f"{p} is not a PyTorch checkpoint (neither a torch.save zip archive nor a pickle)")
    if magic == b"PK":
        _check_zip(p)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(p, map_location="cpu", weights_only=not trust)
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise UntrustedPickleError(f"{p} was refused: {TRUST_HINT}") from e
        raise ModelLoadError(f"{p} is not a readable PyTorch checkpoint ({type(e).__name__}: {short_error(e)})") from e


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file's tensors (a format that holds no code, so no trust is needed).

    Raises:
        ModelLoadError: for a damaged file or a missing ``safetensors`` package.
    """
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ModelLoadError(f"{path} is a safetensors file: pip install safetensors") from e
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({short_error(e)})") from e


def _check_zip(path: Path) -> None:
    """Refuse a damaged archive, or one whose members would inflate far beyond the file's size."""
    try:
        with zipfile.ZipFile(path) as archive:
            expanded = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ModelLoadError(f"{path} is truncated or damaged (not a complete zip archive: {short_error(e)}); "
                             "download or save it again") from e
    size = path.stat().st_size
    if expanded > size + ZIP_EXPANSION_SLACK:
        raise ModelLoadError(f"{path} is a compressed archive that would expand from {size} to {expanded} bytes "
                             "in memory; torch.save never compresses, so re-save the model with torch.save")


def short_error(error: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), for one-line messages."""
    text = str(error).strip().splitlines()
    return text[0][:200] if text else "no details"


#: Key names quoted in a mismatch message, so a wrong --arch gives one line, not thousands of keys.
MISMATCH_EXAMPLES = 3


def describe_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str | None:
    """One line saying how a ``state_dict`` differs from the one a model expects.

    Args:
        expected: the model's own ``state_dict()``.
        found: the ``state_dict`` read from a file.

    Returns:
        the counts of missing, unexpected and mis-shaped keys with up to
        :data:`MISMATCH_EXAMPLES` examples, or ``None`` when every key and shape matches.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    misshaped = [k for k in expected if k in found and tuple(found[k].shape) != tuple(expected[k].shape)]
    if not (missing or unexpected or misshaped):
        return None
    examples = ([f"{_clip(k)}: file {_shape(found[k])}, model {_shape(expected[k])}" for k in misshaped]
                + [f"{_clip(k)} missing" for k in missing]
                + [f"{_clip(k)} unexpected" for k in unexpected])[:MISMATCH_EXAMPLES]
    return (f"{len(missing)} missing, {len(unexpected)} unexpected and {len(misshaped)} mis-shaped keys "
            f"(e.g. {'; '.join(examples)})")


def _clip(key: str, limit: int = 60) -> str:
    return key if len(key) <= limit else "..." + key[-(limit - 3):]


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"
