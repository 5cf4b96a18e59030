"""Text for language models: the ``text`` dataset specs, read, tokenized and cut into fixed-length blocks.

Specs:

* ``text`` (or ``text:``): the reStructuredText sources of the Python 3.11
  documentation, from Debian's ``python3.11-doc`` (497 files, about 11 MB under
  ``/usr/share/doc/python3.11/html/_sources/``; ``make data`` installs it);
* ``text:FILE`` or ``text:DIR``: your own text, a ``.txt``, ``.rst`` or ``.md``
  file, or every such file under a folder (sub-folders included).

Splits are by file and fixed: each file's path relative to the folder is
hashed (SHA-256) to a number in [0, 1); below 0.90 the file is in ``train``,
below 0.95 in ``val``, else in ``test`` (so adding files never moves the
others; see :mod:`optkit.data.splits`). Text that leaves a split without a file (a single file, a small
folder) is split by lines instead: its first 90 % of lines are ``train``, the
next 5 % ``val`` and the last 5 % ``test``.

Each document is tokenized by the model's own tokenizer (loaded from its
``save_pretrained`` folder, local files only, without special tokens), ends
with the tokenizer's end-of-sequence token when it has one, and the documents
are joined and cut into blocks of ``seq_len`` tokens; the last block is padded,
with its padding masked out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError
from optkit.data.splits import SPLIT_BOUNDS, name_split

if TYPE_CHECKING:
    import torch

__all__ = ["PYTHON_DOCS_DIR", "SPLIT_BOUNDS", "TEXT_SUFFIXES", "TOKENIZER_FILES", "TokenBlocks", "find_tokenizer",
           "load_tokenizer", "next_token_dataset", "read_documents", "text_files", "token_blocks", "tokenize"]

PYTHON_DOCS_DIR = "/usr/share/doc/python3.11/html/_sources"
PYTHON_DOCS_HINT = "install them with `apt-get install python3.11-doc` (make data does), or give text:FILE or text:DIR"
TEXT_SUFFIXES = (".txt", ".rst", ".md")
#: Characters of a split tokenized at most to spread blocks across it (``token_blocks(spread=True)``): about 4 s.
SPREAD_CHARACTERS = 16_000_000
#: Any of these in a folder means it holds a tokenizer ``AutoTokenizer`` can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass
class TokenBlocks:
    """Token ids cut into blocks of one length, the last one padded.

    Attributes:
        input_ids: int64 ``N×L`` token ids (padding positions hold the pad id, or 0).
        attention_mask: int64 ``N×L``, 1 on text and 0 on padding.
        tokens: the number of text tokens (the mask's sum).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: int


def text_root(arg: str) -> Path:
    """The file or folder a ``text`` spec's argument names (the Python documentation for ``""``)."""
    return Path(arg or PYTHON_DOCS_DIR)


def text_files(arg: str) -> list[Path]:
    """The text files a ``text`` spec reads, sorted by path.

    Args:
        arg: what follows ``text:`` (``""`` for the Python documentation).

    Returns:
        the ``.txt``, ``.rst`` and ``.md`` files (one for ``text:FILE``).

    Raises:
        DataError: for a missing path, a file of another type, or a folder without text files.
    """
    root = text_root(arg)
    if root.is_file():
        if not root.name.endswith(TEXT_SUFFIXES):
            raise DataError(f"text:{arg} is not a {', '.join(TEXT_SUFFIXES)} file; give text:FILE or text:DIR "
                            "with such files")
        return [root]
    if not root.is_dir():
        if not arg:
            raise DataError(f"the Python documentation sources ({PYTHON_DOCS_DIR}) are not installed; {PYTHON_DOCS_HINT}")
        raise DataError(f"text:{arg}: no such file or folder; give text:FILE or text:DIR with "
                        f"{', '.join(TEXT_SUFFIXES)} files")
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"{root} holds no {', '.join(TEXT_SUFFIXES)} files; give text:FILE or text:DIR with text in them")
    return files


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from e
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}); check that it exists and is readable") from e


def read_documents(spec_arg: str, split: str) -> list[str]:
    """The documents (one per file, or one piece of lines) of a ``text`` spec's ``split``.

    Args:
        spec_arg: what follows ``text:`` (``""`` for the Python documentation).
        split: ``train``, ``val`` or ``test`` (see the module docstring).

    Returns:
        the split's documents, in path order.

    Raises:
        DataError: for a bad split, missing or unreadable files, or no text in the split.
    """
    if split not in SPLIT_BOUNDS:
        raise DataError(f"split must be one of {', '.join(SPLIT_BOUNDS)}; got {split!r}")
    root = text_root(spec_arg)
    files = text_files(spec_arg)
    names = [p.relative_to(root).as_posix() if root.is_dir() else p.name for p in files]
    by_split = {s: [f for f, name in zip(files, names) if name_split(name) == s] for s in SPLIT_BOUNDS}
    if all(by_split.values()):
        documents = [_read(path) for path in by_split[split]]
    else:
        documents = [_lines_share([_read(path) for path in files], split)]
    documents = [d for d in documents if d.strip()]
    if not documents:
        where = f"text:{spec_arg}" if spec_arg else PYTHON_DOCS_DIR
        raise DataError(f"{where} has no text in its {split} split; give a file or folder with more text "
                        "(a split gets 5 % of the lines of a single file)")
    return documents


def _lines_share(texts: list[str], split: str) -> str:
    lines = [line for text in texts for line in text.splitlines(keepends=True)]
    bounds = [0] + [round(len(lines) * bound) for bound in SPLIT_BOUNDS.values()]
    index = list(SPLIT_BOUNDS).index(split)
    return "".join(lines[bounds[index]:bounds[index + 1]])


def find_tokenizer(folders: list[str | os.PathLike | None]) -> Path:
    """The first of ``folders`` that holds tokenizer files (see :data:`TOKENIZER_FILES`).

    Raises:
        DataError: when none does (a ``text`` spec needs the model's own tokenizer).
    """
    candidates = [Path(f) for f in folders if f]
    for folder in candidates:
        if folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    where = ", ".join(str(f) for f in candidates) or "the model's source"
    raise DataError(f"a text spec needs the model's tokenizer, but {where} has no tokenizer files "
                    f"({', '.join(TOKENIZER_FILES[:2])}); give the model as a save_pretrained folder with its tokenizer")


def load_tokenizer(folder: str | os.PathLike) -> Any:
    """The tokenizer saved in ``folder``, read with ``AutoTokenizer`` from local files only (no code from the folder runs).

    Raises:
        DataError: when transformers is missing or cannot read the files.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise DataError("text specs need transformers to read the model's tokenizer: pip install transformers") from e
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DataError(f"cannot load the tokenizer in {folder} ({first[:200]}); save it with "
                        "tokenizer.save_pretrained(FOLDER)") from e


#: Documents tokenized at a time when only the first tokens are needed.
TOKENIZE_CHUNK = 16


def tokenize(tokenizer: Any, documents: list[str], limit: int | None = None) -> list[int]:
    """The documents' token ids, joined, each document followed by the end-of-sequence token when there is one.

    With ``limit``, documents are tokenized a few at a time until at least ``limit`` ids are there
    (calibration and small evaluations read the start of a split, not all of it).
    """
    from optkit.core.progress import progress

    eos = getattr(tokenizer, "eos_token_id", None)
    # All of a split in about 20 calls (progress shows where it takes long), or a few documents at a time.
    step = max(TOKENIZE_CHUNK, -(-len(documents) // 20)) if limit is None else TOKENIZE_CHUNK
    shown = progress("text", "documents tokenized", len(documents))
    ids: list[int] = []
    for start in range(0, len(documents), max(step, 1)):
        chunk = documents[start:start + step]
        for document in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(document)
            if eos is not None:
                ids.append(eos)
        shown.step(len(chunk))
        if limit is not None and len(ids) >= limit:
            break
    return ids


def token_blocks(spec_arg: str, split: str, tokenizer_folder: str | os.PathLike, seq_len: int, *,
                 vocab_size: int | None = None, max_positions: int | None = None,
                 max_blocks: int | None = None, spread: bool = False) -> TokenBlocks:
    """A ``text`` spec's ``split``, tokenized by the tokenizer in ``tokenizer_folder``, in blocks of ``seq_len``.

    Args:
        spec_arg: what follows ``text:`` (``""`` for the Python documentation).
        split: ``train``, ``val`` or ``test``.
        tokenizer_folder: the model's ``save_pretrained`` folder holding its tokenizer.
        seq_len: tokens per block.
        vocab_size: the model's embedding rows; a tokenizer with more tokens is refused.
        max_positions: the model's positions (``max_position_embeddings``); longer blocks are refused.
        max_blocks: keep only the first this many blocks.
        spread: with ``max_blocks``, take that many blocks evenly spaced across the whole split instead of its
            first ones (from at most :data:`SPREAD_CHARACTERS` of it, in evenly spaced extracts): calibration
            that sees the whole split, not its first files.

    Returns:
        the :class:`TokenBlocks`.

    Raises:
        DataError: for missing, unreadable or empty text, a tokenizer that cannot be
            read or does not fit ``vocab_size``, or ``seq_len`` beyond ``max_positions``.
    """
    import torch

    if seq_len < 1:
        raise DataError(f"sequences need at least 1 token, got {seq_len}; set --seq-len")
    if max_positions is not None and seq_len > max_positions:
        raise DataError(f"sequences of {seq_len} tokens are longer than the model's {max_positions} positions "
                        f"(max_position_embeddings); set --seq-len {max_positions} or less")
    documents = read_documents(spec_arg, split)
    tokenizer = load_tokenizer(tokenizer_folder)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise DataError(f"the tokenizer in {tokenizer_folder} has {len(tokenizer):,} tokens but the model's embedding "
                        f"has {vocab_size:,} rows; use the tokenizer the model was trained with")
    spread = spread and max_blocks is not None
    if spread:
        documents = _extracts(documents, max_blocks, SPREAD_CHARACTERS)
    limit = None if max_blocks is None or spread else max_blocks * seq_len
    ids = torch.tensor(tokenize(tokenizer, documents, limit), dtype=torch.long)
    if not len(ids):
        raise DataError(f"text:{spec_arg} gives no tokens in its {split} split; give a file or folder with more text")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise DataError(f"the tokenizer in {tokenizer_folder} gives token id {int(ids.max())}, beyond the model's "
                        f"{vocab_size:,} embedding rows; use the tokenizer the model was trained with")
    full = len(ids) // seq_len
    if spread and full > max_blocks:
        rows = torch.linspace(0, full - 1, max_blocks).round().long()
        return TokenBlocks(ids[:full * seq_len].view(full, seq_len)[rows], torch.ones(max_blocks, seq_len,
                                                                                      dtype=torch.long),
                           max_blocks * seq_len)
    count = -(-len(ids) // seq_len)
    if max_blocks is not None:
        count = min(count, max_blocks)
        ids = ids[:count * seq_len]
    pad = getattr(tokenizer, "pad_token_id", None)
    input_ids = torch.full((count * seq_len,), pad if pad is not None else 0, dtype=torch.long)
    mask = torch.zeros(count * seq_len, dtype=torch.long)
    input_ids[:len(ids)] = ids
    mask[:len(ids)] = 1
    return TokenBlocks(input_ids.view(count, seq_len), mask.view(count, seq_len), len(ids))


def _extracts(documents: list[str], pieces: int, budget: int) -> list[str]:
    """``documents`` when they hold at most ``budget`` characters; else ``pieces`` extracts of ``budget // pieces``
    characters each, evenly spaced across them, each from the start of a line (and within one document)."""
    import bisect
    import itertools

    starts = [0, *itertools.accumulate(map(len, documents))]
    total = starts[-1]
    if total <= budget:
        return documents
    size = max(1, budget // pieces)
    extracts = []
    for piece in range(pieces):
        offset = piece * total // pieces
        index = bisect.bisect_right(starts, offset) - 1
        document = documents[index]
        begin = document.rfind("\n", 0, offset - starts[index]) + 1
        extracts.append(document[begin:begin + size])
    return extracts


def next_token_dataset(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.utils.data.TensorDataset:
    """``(block, next tokens)`` pairs for training a causal language model on blocks of token ids.

    The label at each position is the token that follows it; the last position of a block and positions whose
    next token is padding are labelled -100 (:data:`~optkit.passes.finetune.objectives.IGNORE_INDEX`: not scored).
    """
    import torch

    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = torch.where(attention_mask[:, 1:].bool(), input_ids[:, 1:], -100)
    return torch.utils.data.TensorDataset(input_ids, labels)

