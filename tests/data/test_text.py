"""Tests for optkit/data/text.py and the text specs: splits by file, the model's tokenizer, blocks, bad text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from optkit.core.errors import DataError
from optkit.data import check_available, dataset_info, load_dataset, parse_spec
from optkit.data.text import PYTHON_DOCS_DIR, find_tokenizer, read_documents, text_files, token_blocks

WORDS = "the model prunes heads and channels of a small network while its text keeps meaning".split()


def write_corpus(folder: Path, files: int = 40, lines: int = 6) -> Path:
    """``files`` deterministic text files of ``lines`` lines each (a few words in a fixed rotation)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        text = "\n".join(" ".join(WORDS[(i * 7 + j * 3 + k) % len(WORDS)] for k in range(9)) for j in range(lines))
        (folder / f"doc{i:02d}.txt").write_text(text + "\n", encoding="utf-8")
    return folder


def save_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved with ``save_pretrained`` into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(str(folder))
    return folder


def _expected_split(name: str) -> str:
    # The documented rule: SHA-256 of the relative path, first 8 bytes big-endian over 2**64; 0.90 / 0.95 bounds.
    share = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2 ** 64
    return "train" if share < 0.90 else "val" if share < 0.95 else "test"


def test_a_folder_is_split_by_file_with_the_documented_hash_rule(tmp_path):
    corpus = write_corpus(tmp_path / "c", files=60)
    expected = {split: [p.read_text() for p in sorted(corpus.iterdir()) if _expected_split(p.name) == split]
                for split in ("train", "val", "test")}
    assert all(expected.values())  # 60 files give every split at least one
    for split, documents in expected.items():
        assert read_documents(str(corpus), split) == documents
    # Adding files never moves the others.
    (corpus / "new.md").write_text("another file\n", encoding="utf-8")
    assert set(expected["test"]) <= set(read_documents(str(corpus), "test"))


def test_a_single_file_is_split_by_lines(tmp_path):
    lines = [f"line {i}\n" for i in range(40)]
    path = tmp_path / "notes.md"
    path.write_text("".join(lines), encoding="utf-8")
    # 40 lines: train 0..35 (90 %), val 36..37, test 38..39.
    assert read_documents(str(path), "train") == ["".join(lines[:36])]
    assert read_documents(str(path), "val") == ["".join(lines[36:38])]
    assert read_documents(str(path), "test") == ["".join(lines[38:])]


def test_only_text_suffixes_are_read_from_a_folder(tmp_path):
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.txt", "sub/b.rst", "c.md", "d.py", "e.rst.txt"):
        (folder / name).write_text("x\n", encoding="utf-8")
    assert [p.relative_to(folder).as_posix() for p in text_files(str(folder))] == ["a.txt", "c.md", "e.rst.txt",
                                                                                  "sub/b.rst"]


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda d: d / "missing", "no such file or folder"),
    (lambda d: (d / "empty.txt").write_text("  \n\n", encoding="utf-8") and d / "empty.txt", "has no text"),
    (lambda d: (d / "latin.txt").write_bytes(b"caf\xe9 au lait\n" * 30) and d / "latin.txt", "not UTF-8"),
    (lambda d: (d / "code.py").write_text("x = 1\n", encoding="utf-8") and d / "code.py", ".md file"),
    (lambda d: (d / "nothing").mkdir() or d / "nothing", "holds no .txt, .rst, .md files"),
], ids=["missing", "empty", "not-utf8", "wrong-suffix", "no-text-files"])
def test_bad_text_is_one_line_naming_the_fix(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(DataError, match=fragment) as error:
        read_documents(str(path), "test")
    assert "\n" not in str(error.value)


def test_text_specs_parse_and_are_refused_where_images_are_read(tmp_path):
    assert parse_spec("text").kind == "text" and parse_spec("text").arg == ""
    assert parse_spec("text:notes.md").arg == "notes.md"
    with pytest.raises(DataError, match="take no query"):
        parse_spec("text:notes.md?mean=0")
    with pytest.raises(DataError, match="text for language models"):
        dataset_info("text:notes.md")
    with pytest.raises(DataError, match="text for language models"):
        load_dataset("text:notes.md", "test")
    with pytest.raises(DataError, match="no such file"):
        check_available(f"text:{tmp_path / 'missing'}")
    check_available(f"text:{write_corpus(tmp_path / 'c', files=3)}")


def test_blocks_are_the_tokenizers_ids_with_an_end_token_per_document_and_a_masked_tail(tmp_path):
    from transformers import AutoTokenizer

    corpus = write_corpus(tmp_path / "c", files=40)
    folder = save_tokenizer(tmp_path / "tok", [p.read_text() for p in corpus.iterdir()])
    blocks = token_blocks(str(corpus), "test", folder, 16)

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = []
    for path in sorted(corpus.iterdir()):
        if _expected_split(path.name) == "test":
            ids += tokenizer.encode(path.read_text(), add_special_tokens=False) + [eos]
    rows = -(-len(ids) // 16)
    assert tuple(blocks.input_ids.shape) == (rows, 16) and blocks.tokens == len(ids)
    assert blocks.input_ids.flatten()[:len(ids)].tolist() == ids
    assert blocks.attention_mask.flatten().tolist() == [1] * len(ids) + [0] * (rows * 16 - len(ids))
    assert token_blocks(str(corpus), "test", folder, 16, max_blocks=1).input_ids.tolist() == [ids[:16]]


def test_a_tokenizer_or_length_that_does_not_fit_the_model_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "c", files=40)
    folder = save_tokenizer(tmp_path / "tok", [p.read_text() for p in corpus.iterdir()])
    with pytest.raises(DataError, match="has 300 tokens but the model's embedding has 200 rows"):
        token_blocks(str(corpus), "test", folder, 16, vocab_size=200)
    with pytest.raises(DataError, match="longer than the model's 8 positions.*--seq-len 8"):
        token_blocks(str(corpus), "test", folder, 16, max_positions=8)
    with pytest.raises(DataError, match="no tokenizer files"):
        find_tokenizer([tmp_path / "c"])
    assert find_tokenizer([tmp_path / "c", folder]) == folder


@pytest.mark.skipif(not Path(PYTHON_DOCS_DIR).is_dir(), reason="python3.11-doc is not installed (make data)")
def test_the_python_documentation_splits_hold_every_file_once():
    files = text_files("")
    counts = {split: len(read_documents("", split)) for split in ("train", "val", "test")}
    assert len(files) >= 400
    # Files with no text are dropped, so the splits hold at most every file once.
    assert sum(counts.values()) <= len(files) and sum(counts.values()) >= len(files) - 5
    assert counts["val"] >= 10 and counts["test"] >= 10


def test_the_first_blocks_are_the_same_whether_or_not_the_rest_is_tokenized(tmp_path):
    """A calibration read of the first blocks tokenizes a few documents at a time; it must not change them."""
    lm = Path(__file__).resolve().parents[2] / "optkit" / "demo" / "python_docs_lm"
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(60):  # more files than one tokenizing chunk
        (texts / f"doc{i:02d}.txt").write_text(f"Document {i}: " + "the quick brown fox jumps; " * (i % 7 + 1))
    whole = token_blocks(str(texts), "train", lm, 16)
    first = token_blocks(str(texts), "train", lm, 16, max_blocks=3)
    assert len(whole.input_ids) > 3
    assert torch.equal(first.input_ids, whole.input_ids[:3]) and torch.equal(first.attention_mask, whole.attention_mask[:3])


def test_next_token_labels_are_the_following_token_and_skip_padding_and_block_ends():
    from optkit.data.text import next_token_dataset

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    dataset = next_token_dataset(ids, mask)
    assert [dataset[i][1].tolist() for i in range(2)] == [[6, 7, 8, -100], [10, -100, -100, -100]]
    assert torch.equal(dataset[1][0], ids[1])


def test_spread_blocks_come_from_across_the_whole_split_not_its_start(tmp_path):
    lm = Path(__file__).resolve().parents[2] / "optkit" / "demo" / "python_docs_lm"
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "one.txt").write_text("".join(f"line {i} of a long single file\n" for i in range(4000)))
    whole = token_blocks(str(texts), "train", lm, 16)
    spread = token_blocks(str(texts), "train", lm, 16, max_blocks=5, spread=True)
    full = whole.tokens // 16
    rows = [round(i * (full - 1) / 4) for i in range(5)]
    assert spread.input_ids.tolist() == whole.input_ids[rows].tolist()  # evenly spaced, first and last included
    assert spread.attention_mask.sum().item() == spread.tokens == 5 * 16


def test_spread_blocks_of_a_split_over_the_budget_come_from_evenly_spaced_extracts(tmp_path, monkeypatch):
    from optkit.data import text

    lm = Path(__file__).resolve().parents[2] / "optkit" / "demo" / "python_docs_lm"
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "one.txt").write_text("".join(f"alpha {i}\n" for i in range(3000)) + "".join(f"omega {i}\n"
                                                                                        for i in range(3000)))
    monkeypatch.setattr(text, "SPREAD_CHARACTERS", 2000)  # a small part of the split's characters
    blocks = token_blocks(str(texts), "train", lm, 8, max_blocks=4, spread=True)
    tokenizer = text.load_tokenizer(lm)
    decoded = [tokenizer.decode(row) for row in blocks.input_ids.tolist()]
    assert "alpha" in decoded[0] and "omega" in decoded[-1]  # the start and the end of the split
    assert len(blocks.input_ids) == 4
