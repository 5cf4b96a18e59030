"""Hugging Face folders: a ``save_pretrained`` directory in (``hf:DIR``, or any folder holding ``config.json``).

The model class comes from the config's ``architectures`` (a causal LM, a
sequence or image classifier, a base model), always one of ``transformers``'
own classes: no code from the folder runs. Weights are read from
``model.safetensors`` or the shards a ``model.safetensors.index.json`` lists,
never from a pickle unless the user trusts the folder. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from optkit.core.errors import ModelLoadError, UntrustedPickleError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["HF_PREFIX", "PRETRAINED_FILES", "build_from_config", "hf_folder", "is_hf_spec", "load_folder",
           "safetensors_header", "save_pretrained_folder", "stock_class"]

HF_PREFIX = "hf:"
CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: How far a reloaded model's outputs may be from the pruned model's, relative to their largest magnitude.
RELOAD_RTOL = 1e-5
#: Weights are written in shards of at most this size, with ``model.safetensors.index.json`` listing them
#: (the size most released checkpoints use; ``transformers`` 5 would write one file up to 50 GB).
MAX_SHARD_SIZE = "5GB"
#: Models up to this many bytes of weights are checked by reloading them with their stock class and comparing
#: outputs; larger ones tensor by tensor against the written files, so the check holds no second copy.
RELOAD_CHECK_MAX_BYTES = 2 ** 30


def is_hf_spec(spec: str | os.PathLike) -> bool:
    """Whether a model or architecture spec is ``hf:DIR`` (a ``save_pretrained`` folder's config)."""
    return os.fspath(spec).startswith(HF_PREFIX)


def hf_folder(spec: str) -> Path | None:
    """The folder a spec names when it is ``hf:DIR`` or a directory holding ``config.json``, else ``None``.

    Raises:
        ModelLoadError: for ``hf:DIR`` whose folder or ``config.json`` is missing.
    """
    text = str(spec)
    folder = Path(text[len(HF_PREFIX):]) if is_hf_spec(text) else Path(text)
    if not is_hf_spec(text):
        return folder if folder.is_dir() and (folder / CONFIG).is_file() else None
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder (hf:DIR names a folder written by save_pretrained)")
    if not (folder / CONFIG).is_file():
        raise ModelLoadError(f"{folder} has no config.json; hf:DIR needs a folder written by save_pretrained")
    return folder


def _class_and_config(folder: Path, config: dict[str, Any] | None = None) -> tuple[type, Any]:
    try:
        import transformers
    except ImportError as e:
        raise ModelLoadError("a Hugging Face folder needs transformers: pip install transformers") from e
    try:
        if config is not None:
            fields = dict(config)
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                             trust_remote_code=False)
    except Exception as e:
        reason = first_line(e, limit=200)
        raise ModelLoadError(f"{folder / CONFIG} is not a config transformers can read ({reason})") from e
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else transformers.AutoModel
    if cls is None:
        raise ModelLoadError(f"{folder / CONFIG} names architecture {names[0]!r}, which is not a transformers class "
                             "(optkit never runs a folder's own code)")
    return cls, config


def build_from_config(folder: str | os.PathLike, config: dict[str, Any] | None = None) -> nn.Module:
    """The ``transformers`` model the folder's config (or ``config``, a config's ``to_dict()``) describes,
    with fresh (random) weights.

    Raises:
        ModelLoadError: for a missing ``transformers``, an unreadable config, or an
            architecture that is not one of ``transformers``' classes.
    """
    import transformers

    folder = Path(folder)
    cls, config = _class_and_config(folder, config)
    try:
        return cls._from_config(config) if cls is transformers.AutoModel else cls(config)
    except Exception as e:
        reason = first_line(e, limit=200)
        raise ModelLoadError(f"cannot build {cls.__name__} from {folder / CONFIG} ({reason})") from e


def load_folder(folder: str | os.PathLike, *, trust: bool = False,
                random_weights: bool = False) -> tuple[nn.Module, list[str]]:
    """The folder's model with its weights, loaded by its ``transformers`` class (which also maps the weight
    names a version of transformers renamed), and what the user should know.

    Args:
        folder: a ``save_pretrained`` folder.
        trust: allow weights stored only as a pickle.
        random_weights: build a folder that holds a config and no weights with random weights (``--random-weights``)
            instead of refusing it.

    Returns:
        the model (eval mode) and notes: a folder without weights built with ``random_weights`` says so.

    Raises:
        UntrustedPickleError: for weights stored only as a pickle, without ``trust``.
        ModelLoadError: for a folder without weights (unless ``random_weights``), shards without the index that
            lists them or missing from it, weights that do not fit the config (the counts of missing,
            unexpected and mis-shaped keys, with examples) or files transformers cannot read.
    """
    from optkit.io.weights import mark_random_weights

    folder = Path(folder)
    _check_shards(folder)
    has_safetensors = (folder / SAFETENSORS).is_file() or (folder / SAFETENSORS_INDEX).is_file()
    pickled = [name for name in PICKLED if (folder / name).is_file()]
    if not has_safetensors and not pickled:
        if not random_weights:
            _class_and_config(folder)  # a config that names no transformers class is refused for that first
            raise ModelLoadError(f"{folder} has a config.json but no weights ({SAFETENSORS} or its shards), so "
                                 "nothing was loaded: copy the weights into it, or pass --random-weights to build the "
                                 "model with random weights")
        note = (f"{folder} has a config but no weights (model.safetensors): the model has random weights "
                "(--random-weights), so accuracy figures mean nothing")
        return mark_random_weights(build_from_config(folder).eval(), note), [note]
    if not has_safetensors and not trust:
        raise UntrustedPickleError(f"{folder} stores its weights only as a pickle ({pickled[0]}); "
                                   "save them with save_pretrained(safe_serialization=True), or pass --trust "
                                   "if you trust where the folder came from")
    cls, config = _class_and_config(folder)
    try:
        with _quiet_transformers():
            model, info = cls.from_pretrained(str(folder), config=config, local_files_only=True,
                                              use_safetensors=has_safetensors, output_loading_info=True,
                                              ignore_mismatched_sizes=True)
    except Exception as e:
        raise ModelLoadError(f"transformers cannot read the weights in {folder} ({first_line(e, limit=200)})") from e
    counts = {kind: list(info.get(f"{kind}_keys") or []) for kind in ("missing", "unexpected", "mismatched")}
    if any(counts.values()):
        examples = [f"{_key(k)} {kind}" for kind, keys in counts.items() for k in keys][:3]
        raise ModelLoadError(f"the weights in {folder} do not fit its config.json: {len(counts['missing'])} missing, "
                             f"{len(counts['unexpected'])} unexpected and {len(counts['mismatched'])} mis-shaped keys "
                             f"(e.g. {'; '.join(examples)})")
    return model.eval(), []


def _check_shards(folder: Path) -> None:
    """Refuse shards of weights that their index does not list whole: an index naming a shard the folder lacks, or
    shards (``model-00001-of-00004.safetensors``) without the index that lists them."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a shard index transformers wrote ({first_line(e)})") from e
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks {len(missing)} of the {len(shards)} weight shards its "
                                 f"{SAFETENSORS_INDEX} lists ({_some(missing)}); copy them into it")
    elif not (folder / SAFETENSORS).is_file():
        shards = sorted(p.name for p in folder.glob("*-of-*.safetensors"))
        if shards:
            raise ModelLoadError(f"{folder} holds weight shards ({_some(shards)}) but not the {SAFETENSORS_INDEX} "
                                 "that lists them; copy it into the folder")


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _key(entry: Any) -> str:
    key = entry[0] if isinstance(entry, (tuple, list)) else str(entry)
    return key if len(key) <= 60 else "..." + key[-57:]


#: Tokenizer files copied from the input folder into a ``save_pretrained`` output, when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "preprocessor_config.json", "chat_template.jinja")
#: Files ``save_pretrained`` writes that a run may replace (shards are named per model and listed by the index).
PRETRAINED_FILES = (CONFIG, SAFETENSORS, SAFETENSORS_INDEX, "generation_config.json", *TOKENIZER_FILES)


def stock_class(model: Any) -> type:
    """The ``transformers`` class a model is (a user's subclass counts as its ``transformers`` base class)."""
    return next((cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers.")), type(model))


def save_pretrained_folder(model: nn.Module, folder: str | os.PathLike, *, source: str | os.PathLike | None = None,
                           check_inputs: dict[str, Any] | None = None) -> tuple[list[str], str | None]:
    """Write ``model`` as a ``save_pretrained`` folder and check that its stock class loads it back exactly.

    The weights keep the model's dtype (a bf16 model is written in bf16) and are sharded above
    :data:`MAX_SHARD_SIZE`, with ``model.safetensors.index.json``. A model of up to
    :data:`RELOAD_CHECK_MAX_BYTES` is reloaded by its stock class and must give the same outputs; a larger one
    is checked without a second copy: the stock class built from the written config (on the meta device) must
    take every weight's shape, and every written tensor must equal the model's.

    Args:
        model: a ``transformers`` model (see :func:`optkit.kinds.is_hf_pretrained`), possibly pruned.
        folder: where to write (a staging folder: nothing is published here).
        source: the folder the model was loaded from; its tokenizer files are copied.
        check_inputs: keyword inputs whose outputs must be equal after reloading.

    Returns:
        the files written, and ``None``; or no files and the reason the stock
        class cannot load the model (e.g. layers of different widths, which its
        config cannot describe), with everything this call wrote removed.
    """
    import shutil

    folder = Path(folder)
    before = set(folder.iterdir())
    stock = stock_class(model)
    with _quiet_transformers():
        model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    _name_stock_class(folder / CONFIG, stock)
    if source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, folder / name)
    written = sorted(p for p in folder.iterdir() if p not in before)
    reason = _config_mismatch(model, folder)
    try:
        if reason is None:
            large = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > RELOAD_CHECK_MAX_BYTES
            compared = _compare_written(model, folder) if large else False
            reason = None if compared else _reload_mismatch(model, stock, folder, check_inputs)
    except Exception as e:
        reason = first_line(e, limit=200)
    if reason is None:
        return [p.name for p in written], None
    for path in written:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return [], (f"{stock.__name__}.from_pretrained cannot load the pruned model ({reason}): its config does not "
                "describe the pruned widths (layers of different widths, or layers the config has no field for), "
                "so no save_pretrained files were written; model.pt holds the model and loads with "
                "optkit.load_model")


def _reload_mismatch(model: nn.Module, stock: type, folder: Path, check_inputs: dict[str, Any] | None) -> str | None:
    """Why the stock class's reload of ``folder`` is not ``model`` (keys, then outputs on ``check_inputs``)."""
    import torch

    with _quiet_transformers():
        reloaded, info = stock.from_pretrained(str(folder), local_files_only=True, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        return "; ".join(f"{len(v)} {k.replace('_', ' ')}" for k, v in problems.items())
    if check_inputs is None:
        return None
    with torch.no_grad():
        reloaded_out, expected = _logits(reloaded.eval()(**check_inputs)), _logits(model.eval()(**check_inputs))
    del reloaded
    # The same weights give the same outputs up to float rounding (kernels may differ after a reload).
    same = torch.allclose(reloaded_out, expected, rtol=0, atol=RELOAD_RTOL * float(expected.abs().max()))
    return None if same else "its outputs differ from the pruned model's"


def _compare_written(model: nn.Module, folder: Path) -> bool:
    """Whether the safetensors in ``folder`` hold exactly ``model``'s weights, read one tensor at a time: every
    written tensor equals the model's of the same name, and every weight not written is tied to one that is.
    ``False`` when the names differ (a class that renames weights on saving): the caller reloads instead."""
    import torch

    state = model.state_dict()
    index = folder / SAFETENSORS_INDEX
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else [SAFETENSORS])
    written: set[str] = set()
    for name in files:
        for key, tensor in _read_safetensors(folder / name):
            if key not in state:
                return False
            if not torch.equal(tensor, state[key].detach().cpu()):
                raise ValueError(f"the written {key} differs from the model's")
            written.add(key)
    pointers = {state[key].data_ptr() for key in written}
    return all(key in written or state[key].data_ptr() in pointers for key in state)


def safetensors_header(file: BinaryIO) -> dict[str, Any]:
    """The JSON header of an open safetensors file (its tensors' dtypes, shapes and offsets); the file is left
    at the first tensor's bytes."""
    return json.loads(file.read(int.from_bytes(file.read(8), "little")))


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, read (not memory-mapped) one at a time: checking a written model then
    holds one tensor, not the file's pages."""
    import torch

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
    with open(path, "rb") as f:
        header = safetensors_header(f)
        start = f.tell()
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            f.seek(start + begin)
            data = bytearray(f.read(end - begin))
            if entry["dtype"] not in dtypes:
                raise ValueError(f"{path.name}: {key} has dtype {entry['dtype']}, which is not compared here")
            flat = torch.frombuffer(data, dtype=dtypes[entry["dtype"]]) if data else \
                torch.empty(0, dtype=dtypes[entry["dtype"]])
            yield key, flat.reshape(entry["shape"])


def _name_stock_class(config_file: Path, stock: type) -> None:
    # save_pretrained records the model's own class; a subclass of a transformers class is loaded as that class.
    config = json.loads(config_file.read_text())
    if config.get("architectures") != [stock.__name__]:
        config["architectures"] = [stock.__name__]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _config_mismatch(model: nn.Module, folder: Path) -> str | None:
    """How the weights differ from what the stock class builds from the written config, or ``None``."""
    import torch

    from optkit.io.weights import describe_mismatch

    with torch.device("meta"):  # shapes only: nothing is allocated or initialized
        fresh = build_from_config(folder)
    return describe_mismatch(fresh.state_dict(), model.state_dict())


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and load reports off while optkit saves and checks (optkit reports the outcome)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _logits(output: Any) -> Any:
    return output.logits if getattr(output, "logits", None) is not None else output[0]
